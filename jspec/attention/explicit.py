"""Arrays with Explicit shardings (`jax.make_mesh`'s default axis type since jax 0.10) at the edges.

The library moves tokens between ranks by gathers and scatters with data-dependent indices along a
sharded axis; those have no sharding-in-types rule. So where an input carries an Explicit
sharding in its type, the work runs with the mesh's axes Auto (`jax.sharding.auto_axes`: the
compiler places it) and the outputs get Explicit shardings back. Untyped inputs run as they are.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def typed_sharding(x) -> NamedSharding | None:
    """The sharding x carries in its type when its mesh has an Explicit axis, else None."""
    if x is None:
        return None
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty or AxisType.Explicit not in sharding.mesh.axis_types:
        return None
    return sharding


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names, every axis Auto."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def run_auto(fn, args, like):
    """fn(*args), with the mesh's axes Auto if any argument is typed Explicit.

    The outputs (a tuple, one per entry of `like`, None where the output is None) then take the
    sharding of the matching array of `like`, or are replicated where that one is untyped.
    """
    typed = [s for s in map(typed_sharding, jax.tree.leaves(args)) if s is not None]
    if not typed:
        return fn(*args)
    replicated = NamedSharding(typed[0].mesh, PartitionSpec())
    out_sharding = tuple(None if x is None else typed_sharding(x) or replicated for x in like)
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)(*args)
