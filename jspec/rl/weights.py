"""The policy and draft weights' move from the training mesh to the rollout mesh, after every train
step of asynchronous RL, so the sampler always drafts with the draft that was trained with the
policy it samples.

The move never goes through the host. `jax.device_put` copies a shard from device to device when
the source holds exactly the slice the destination wants, and otherwise reads the whole array
back to the host. So the move first reshards, inside `jit` on the bigger side, into whole copies of
the smaller side's layout (an extra leading "copies" mesh axis); every destination shard then has
a source shard of the same slice, and the copy between the device sets is shard for shard. Hence
the rule that one mesh's device count divide the other's (`jspec.rl.meshes`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


def _copies(devices: np.ndarray, like: Mesh) -> Mesh:
    """`devices` as whole copies of `like`'s mesh shape, along a leading 'copies' axis."""
    grid = np.asarray(devices).reshape(-1, *like.devices.shape)
    return Mesh(grid, ("copies", *like.axis_names))


class WeightMover:
    """Moves a pytree from its shardings `src` (training mesh) to `dst` (rollout mesh), device
    to device (module docstring): a reshard in `jit` on the bigger side, then a shard-for-shard
    copy between the device sets."""

    def __init__(self, src, dst):
        leaf = lambda tree: jax.tree.leaves(tree)[0].mesh
        src_mesh, dst_mesh = leaf(src), leaf(dst)
        respec = lambda tree, mesh: jax.tree.map(lambda s: NamedSharding(mesh, s.spec), tree)
        if src_mesh.size >= dst_mesh.size:
            staged = respec(dst, _copies(src_mesh.devices.flat, dst_mesh))
            relayout = jax.jit(lambda x: x, out_shardings=staged)
            self._move = lambda x: jax.device_put(relayout(x), dst)
        else:
            staged = respec(src, _copies(dst_mesh.devices.flat, src_mesh))
            relayout = jax.jit(lambda x: x, out_shardings=dst)
            self._move = lambda x: relayout(jax.device_put(x, staged))

    def __call__(self, tree):
        return self._move(tree)
