"""Where RL rollouts run: on the training mesh (synchronous RL), or on the last devices, a rollout
mesh of fixed sizes (`rl.rollout_mesh`), with the training mesh on the rest (asynchronous RL).
The sizes are checked without devices (`split_sizes`), so a config that does not fit is named
before anything is built."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jspec import mesh as mesh_lib
from jspec.config import ConfigError, MeshConfig


def split_sizes(
    mesh: MeshConfig, rollout: MeshConfig | None, num_devices: int
) -> tuple[dict[str, int], dict[str, int] | None]:
    """The axis sizes of (the training mesh, the rollout mesh or None) on `num_devices`: the
    rollout mesh takes the last devices, the training mesh the rest; clear errors when the sizes
    do not fit."""
    if rollout is None:
        return mesh_lib.mesh_shape(mesh, num_devices), None
    sizes = {axis: getattr(rollout, axis) for axis in mesh_lib.AXES}
    n = math.prod(sizes.values())
    if n >= num_devices:
        raise ConfigError(
            f"rl.rollout_mesh {sizes} takes {n} devices, but only {num_devices} are present, "
            "leaving none for training; shrink rl.rollout_mesh so its axes' product is below "
            f"{num_devices}, or drop it to sample on the training mesh."
        )
    try:
        train = mesh_lib.mesh_shape(mesh, num_devices - n)
    except ConfigError as error:
        raise ConfigError(
            f"{error} (the training mesh gets the {num_devices - n} devices left after "
            f"rl.rollout_mesh's {n})"
        ) from None
    size = math.prod(train.values())
    if max(size, n) % min(size, n):
        raise ConfigError(
            f"the training mesh's {size} devices and rl.rollout_mesh's {n}: one count must "
            "divide the other, so the weights move device to device in whole copies of a layout "
            f"(jspec.rl.weights); e.g. give rl.rollout_mesh {num_devices // 2} of the "
            f"{num_devices} devices."
        )
    return train, sizes


def split_meshes(
    mesh: MeshConfig, rollout: MeshConfig | None, devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh, Mesh | None]:
    """(training mesh, rollout mesh or None) of `split_sizes` on `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    train, rollout_sizes = split_sizes(mesh, rollout, len(devices))
    train_mesh = mesh_lib.make_mesh(MeshConfig(**train), devices[: math.prod(train.values())])
    if rollout_sizes is None:
        return train_mesh, None
    n = math.prod(rollout_sizes.values())
    return train_mesh, mesh_lib.make_mesh(MeshConfig(**rollout_sizes), devices[-n:])
