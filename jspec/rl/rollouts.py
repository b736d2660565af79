"""Where RL rollouts run and with which weights: the sampler side of sync and async RL.

Synchronous RL (no `rl.rollout_mesh`) samples on the training mesh with the TrainState's own
parameters: nothing moves. Asynchronous RL splits the devices: the last ones form the rollout
mesh (`rl.rollout_mesh`, fixed sizes), the rest the training mesh (`mesh`), and after every train
step the new policy and draft parameters move to the rollout mesh device to device, so the sampler
always drafts with the draft that was trained with the policy it samples.

The move never goes through the host. `jax.device_put` copies a shard from device to device when
the source holds exactly the slice the destination wants, and otherwise reads the whole array
back to the host. So the move first reshards, inside `jit` on the bigger side, into whole copies of
the smaller side's layout (an extra leading "copies" mesh axis); every destination shard then has
a source shard of the same slice, and the copy between the device sets is shard for shard. Hence
the rule that one mesh's device count divide the other's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec import hosts
from jspec import mesh as mesh_lib
from jspec.config import ConfigError, MeshConfig, RolloutConfig
from jspec.rl.state import Networks, TrainState
from jspec.sampler import Rollout, generate


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
            f"(jspec.rl.rollouts); e.g. give rl.rollout_mesh {num_devices // 2} of the "
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


class Sampler:
    """The weights rollouts are generated with: policy and draft parameters, the run's key, and
    their version (the train steps they include), on the rollout mesh when the devices are split
    (`networks.mesh` is not the trainer's), else the TrainState's own arrays."""

    def __init__(self, networks: Networks, trainer: Networks):
        self.networks = networks
        self.moves = networks.mesh is not trainer.mesh
        self.trainer = trainer
        self.rows = NamedSharding(networks.mesh, PartitionSpec(mesh_lib.RULES["decode_batch"]))
        self.params, self.rng, self.version = None, None, None
        self._mover = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")

    def load(self, state: TrainState, version: int) -> float:
        """Takes the parameters of `state` (after `version` train steps); the seconds their move
        to the rollout mesh took, from the end of the train step that made them (0: shared)."""
        self.version = version
        if not self.moves:
            self.params, self.rng = state.params, state.rng
            return 0.0
        tree = {"params": state.params, "rng": state.rng}
        if self._mover is None:
            where = lambda nets: {
                "params": nets.shardings(state.params),
                "rng": NamedSharding(nets.mesh, PartitionSpec()),
            }
            self._mover = WeightMover(where(self.trainer), where(self.networks))
        jax.block_until_ready(tree)
        start = time.perf_counter()
        moved = jax.block_until_ready(self._mover(tree))
        self.params, self.rng = moved["params"], moved["rng"]
        return time.perf_counter() - start

    def generate(
        self,
        prompts: np.ndarray,
        prompt_lengths: np.ndarray,
        batch: int,
        step: int,
        config: RolloutConfig,
        speculative: bool = True,
    ) -> Future[Rollout]:
        """Dispatches the rollouts of RL step `step` with the weights held now; returns before
        they are computed. The key depends on the step alone, whatever the weights' version.

        The call runs in the sampler's own thread: a single-device program runs in the thread
        that calls it, and on a GPU the rollout's `while_loop` reads its condition back to the
        host at every step, so from the loop's thread it would hold the train step back until the
        rollout ends. The prompts go straight to the rollout mesh, never by a training device:
        this process's rows (`jspec.hosts`) of a batch of `batch`. `speculative` False decodes
        plainly, without the draft."""
        policy, draft = self.networks.models(self.params)
        draft = draft if speculative else None
        key = jax.random.fold_in(jax.random.wrap_key_data(self.rng), step)
        put = lambda x: hosts.global_array(self.rows, x, batch)  # noqa: E731
        prompts, prompt_lengths = put(prompts), put(prompt_lengths)
        return self._thread.submit(generate, policy, draft, prompts, prompt_lengths, key, config)

    def close(self) -> None:
        self._thread.shutdown()
