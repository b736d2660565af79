"""TapChannel: the policy's tapped hidden states, from the stages that compute them to the draft.

In a pipelined policy the tapped layers live on different stages, and the draft that reads them
sits after the last one. Each stage records the hidden states entering its own tapped layers, per
microbatch, in a side buffer of its own [K, M, ...] (K: the most taps any stage holds). The side
buffer is not part of the shifted stage buffer, so the schedule and its `ppermute`s are the same
with taps on or off. After the loop one `all_gather` over the stage axis delivers every stage's side
buffer (one `ppermute` cannot send several stages to one destination), and each tap is read from
its (stage, slot), aligned by microbatch. Taps are detached where they are recorded: no gradient
crosses stages through them.

Under SPMD every rank of the stage axis receives the taps, the draft's (last) stage among them:
the draft's own computation is not split over stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jspec import mesh as mesh_lib
from jspec.pipeline.schedule import STAGE, Schedule


class TapChannel:
    """Where each tap is recorded (`source`: stage and slot) and how it is delivered."""

    def __init__(self, tap_layers: Sequence[int], schedule: Schedule):
        self.schedule = schedule
        by_stage = [
            sorted(t for t in tap_layers if schedule.stage_of(t) == s)
            for s in range(schedule.stages)
        ]
        self.slots = max(1, *(len(taps) for taps in by_stage))
        table = np.full((schedule.stages, self.slots), -1, np.int32)
        for s, taps in enumerate(by_stage):
            table[s, : len(taps)] = taps
        self.slot_layers = table  # [S, K]: the layer each slot of each stage records (-1: none)
        self.source = [
            (schedule.stage_of(t), by_stage[schedule.stage_of(t)].index(t)) for t in tap_layers
        ]

    def empty(self, x_MX: jax.Array, mesh: Mesh, act) -> jax.Array:
        """The side buffers of all stages [S, K, M, ...], zero, sharded over the stage axis."""
        shape = (self.schedule.stages, self.slots, *x_MX.shape)
        return mesh_lib.constrain(jnp.zeros(shape, x_MX.dtype), mesh, (STAGE, None, None, *act))

    def empty_slots(self, x: jax.Array) -> jax.Array:
        """One stage's slots for one microbatch [K, ...], zero."""
        return jnp.zeros((self.slots, *x.shape), x.dtype)

    def record(self, slots_K: jax.Array, x: jax.Array, stage, layer) -> jax.Array:
        """The slots with `x`, the hidden state entering `layer`, in the slot that taps it (if
        any: a layer no slot taps writes nothing, so an untapped layer costs no traffic)."""
        hit = jnp.asarray(self.slot_layers)[stage] == layer
        slot = jnp.where(jnp.any(hit), jnp.argmax(hit), self.slots)  # out of range: dropped
        return slots_K.at[slot].set(jax.lax.stop_gradient(x), mode="drop")

    def store(self, side_KM, slots_K, micro, busy, repeat, stage) -> jax.Array:
        """One stage's side buffer with the slots that its chunk of `repeat` filled written at
        microbatch `micro` (nothing when the stage idles)."""
        start = self.schedule.chunk_start(repeat, stage)
        layers = jnp.asarray(self.slot_layers)[stage]
        filled = busy & (layers >= start) & (layers < start + self.schedule.layers_per_chunk)
        rows = jnp.where(filled, jnp.arange(self.slots), self.slots)  # out of range: dropped
        return side_KM.at[rows, micro].set(slots_K, mode="drop")

    def deliver(self, side_S: jax.Array, mesh: Mesh) -> jax.Array:
        """Taps [len(tap_layers), M, ...] in the order asked, gathered from every stage."""
        gathered = jax.shard_map(
            lambda x: jax.lax.all_gather(x, STAGE, tiled=True),
            mesh=mesh,
            in_specs=PartitionSpec(STAGE),
            out_specs=PartitionSpec(),
            axis_names={STAGE},
            check_vma=False,  # all_gather's result is the same on every stage
        )(side_S)
        return jnp.stack([gathered[s, k] for s, k in self.source])
