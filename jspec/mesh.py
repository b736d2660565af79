"""The device mesh and the one table that maps logical array axes to mesh axes.

Every array names its axes logically (`("batch", "seq", "act_embed")`, `("embed", "mlp")`);
`RULES` says which mesh axis, if any, each logical name is split over. Changing a parallelism
strategy means changing this table, not the model.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jspec.config import ConfigError, MeshConfig

AXES = ("data", "stage", "context", "tensor")

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": "data",
    "decode_batch": ("data", "context"),  # rollout rows: context is extra data parallelism there
    "seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "stage": "stage",  # the leading axis of the pipeline's stacked stage weights (jspec.pipeline)
    "layers": None,
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    # mixture of experts: experts live where tokens are distinct (jspec.models.moe says why)
    "expert": ("data", "context"),
    "moe_mlp": "tensor",
}


def mesh_shape(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes for `num_devices`, resolving one -1 axis; a clear error when they do not fit."""
    sizes = {axis: getattr(config, axis) for axis in AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size} must be a positive size, or -1 for 'the rest'.")
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            f"mesh axes {free} are all -1; at most one axis may take the devices left over."
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh {sizes} does not fit {num_devices} devices: the fixed axes use {fixed}, "
                f"which does not divide {num_devices}; choose axis sizes whose product divides it."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh {sizes} needs {fixed} devices but {num_devices} are present; make the product "
            f"of mesh.data, mesh.stage, mesh.context and mesh.tensor equal {num_devices} "
            "(or set one of them to -1)."
        )
    return sizes


def use_cpu_devices(count: int) -> None:
    """Run on `count` virtual CPU devices, keeping the other XLA flags. JAX reads this when it
    starts its backend: call it before anything asks for a device."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The 4-axis mesh (data, stage, context, tensor) over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(config, len(devices))
    grid = np.asarray(devices).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def logical_spec(names: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry these logical names (None: replicated)."""
    out = []
    for name in names:
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis {name!r} has no rule in jspec.mesh.RULES")
        out.append(None if name is None else RULES[name])
    return PartitionSpec(*out)


def axis_size(mesh: Mesh, name: str) -> int:
    """How many ways the logical axis `name` is split on `mesh` (1: replicated)."""
    axes = RULES[name]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


def sharding(mesh: Mesh, names: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names))


def constrain(x: jax.Array, mesh: Mesh | None, names: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op without a mesh (single device)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, sharding(mesh, names))


def take_local_rows(x: jax.Array, rows_SR: jax.Array) -> jax.Array:
    """Rows of x [B, ...] picked within each of the S equal blocks its leading axis splits into
    (the blocks that S row shards hold): rows_SR [S, R] indexes rows of each block. The result
    [S * R, ...] keeps block s's picks in block s, so no row moves between the devices of a mesh
    that splits the rows."""
    s, r = rows_SR.shape
    blocks = x.reshape(s, x.shape[0] // s, *x.shape[1:])
    index = rows_SR.reshape(s, r, *(1,) * (x.ndim - 1))
    return jnp.take_along_axis(blocks, index, axis=1).reshape(s * r, *x.shape[1:])
