"""The sampler of RL: the weights rollouts are generated with, and the thread that generates them.

Synchronous RL (no `rl.rollout_mesh`) samples on the training mesh with the TrainState's own
parameters: nothing moves. Asynchronous RL samples on the rollout mesh (`jspec.rl.meshes`), with
the weights moved there after every train step (`jspec.rl.weights`). With partial rollouts the
sampler's thread keeps the completions they carry from step to step (`jspec.rl.partial`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jspec import hosts
from jspec import mesh as mesh_lib
from jspec.config import RolloutConfig
from jspec.rl.partial import Pool, Trained
from jspec.rl.state import Networks, TrainState
from jspec.rl.weights import WeightMover
from jspec.sampler import Rollout, generate


class Sampler:
    """The weights rollouts are generated with: policy and draft parameters, the run's key, and
    their version (the train steps they include), on the rollout mesh when the devices are split
    (`networks.mesh` is not the trainer's), else the TrainState's own arrays."""

    def __init__(self, networks: Networks, trainer: Networks, pool: Pool | None = None):
        self.networks, self.pool = networks, pool
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
        args = self._inputs(prompts, prompt_lengths, batch, step, speculative)
        return self._thread.submit(generate, *args, config)

    def generate_partial(
        self, problems, prompts, prompt_lengths, step: int, config: RolloutConfig, speculative=True
    ) -> Future[tuple[Rollout, Trained, int, bytes]]:
        """`generate` of one process's whole batch of `problems` with the pool's unfinished
        completions continued beside it, returning once at most `pool.rows` rows run: the
        rollout, the groups it completed (taken out of the pool), the tokens it generated and
        the pool's snapshot after it. The pool changes in the sampler's thread alone, rollout
        after rollout."""
        version, batch = self.version, len(problems)
        args = self._inputs(prompts, prompt_lengths, batch, step, speculative)
        everywhere = NamedSharding(self.networks.mesh, PartitionSpec())
        place = lambda arrays: jax.device_put(arrays, everywhere)  # noqa: E731

        def run() -> tuple[Rollout, Trained, int, bytes]:
            inputs = (step, version, problems, prompts, prompt_lengths, place)
            return *self.pool.rollout(args, config, *inputs), self.pool.snapshot()

        return self._thread.submit(run)

    def _inputs(self, prompts, prompt_lengths, batch: int, step: int, speculative: bool):
        """generate's policy, draft (None: plain), prompts, lengths and key for step `step`."""
        policy, draft = self.networks.models(self.params)
        key = jax.random.fold_in(jax.random.wrap_key_data(self.rng), step)
        put = lambda x: hosts.global_array(self.rows, x, batch)  # noqa: E731
        return policy, draft if speculative else None, put(prompts), put(prompt_lengths), key

    def close(self) -> None:
        """Waits for the rollout running now; rollouts dispatched ahead and not begun are dropped
        (a stopped run does not compute steps it will not train)."""
        self._thread.shutdown(cancel_futures=True)
