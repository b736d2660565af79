"""Pipeline parallelism as a scanned stage axis, in the style of MaxText (REFERENCES.md).

Layout. With S stages, R repeats and P layers per chunk (L = R * S * P), layer l = (r * S + s) * P
+ j lives on stage s at row r * P + j of its stack: stage weights are [S, R * P, ...], the leading
axis sharded over mesh axis `stage`. R = 1 is GPipe; R > 1 the circular (interleaved) schedule,
where a microbatch passes through every stage R times and the bubble shrinks R-fold.

Schedule. Item k = r * M + m (microbatch m of M, in repeat r) runs on stage s at iteration k + s;
one `lax.scan` runs M * R + S - 1 iterations, in each of which every stage runs its chunk on its
item (a `vmap` over the stage axis whose sharding constraints gain the `stage` axis), then the
stage buffer moves one stage on by one `ppermute`, a ring. Stage 0 keeps each microbatch in its
own slot of an io buffer: the embedded microbatch at first, then what the last stage hands back,
which starts the microbatch's next repeat (so M >= S when R > 1) or is its final output. Each stage
idles S - 1 iterations of M * R + S - 1: the bubble.

Gradients are autodiff through the scan (all forward, then all backward: SPMD JAX has no 1F1B).
Each iteration's stage computation is rematerialised from its input, so the scan saves one stage
input per iteration. Every stage carries an io buffer of the whole batch's residual stream (only
stage 0's is read: the price of one vmapped body; MaxText rotates a buffer spread over the stages
instead). Activations keep their `data` and `context` sharding inside the pipeline,
weights their `tensor` sharding, so the other mesh axes work as without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jspec import mesh as mesh_lib
from jspec.config import ConfigError, PipelineConfig

STAGE = "stage"  # the mesh axis of the stages


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static shape of a pipeline run: stages S, microbatches M, repeats R, chunk length P."""

    stages: int
    microbatches: int
    repeats: int
    layers_per_chunk: int

    @classmethod
    def of(cls, pipeline: PipelineConfig, num_layers: int) -> Schedule:
        chunks = pipeline.stages * pipeline.repeats
        return cls(pipeline.stages, pipeline.microbatches, pipeline.repeats, num_layers // chunks)

    @property
    def items(self) -> int:
        """Stage visits per stage: every microbatch once per repeat."""
        return self.microbatches * self.repeats

    @property
    def iterations(self) -> int:
        return self.items + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of stage-iterations that are idle: (S - 1) / (M * R + S - 1)."""
        return (self.stages - 1) / self.iterations

    def stage_of(self, layer: int) -> int:
        return (layer // self.layers_per_chunk) % self.stages

    def chunk_start(self, repeat, stage):
        """The first layer of the chunk that `stage` runs in `repeat`."""
        return (repeat * self.stages + stage) * self.layers_per_chunk

    def work(self, i, stage) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(busy, repeat, microbatch) of `stage` at iteration `i`."""
        k = i - stage
        busy = (k >= 0) & (k < self.items)
        k = jnp.clip(k, 0, self.items - 1)
        return busy, k // self.microbatches, k % self.microbatches


def to_stages(w_L: jax.Array, schedule: Schedule) -> jax.Array:
    """Layer-stacked weights [L, ...] as stage weights [S, R * P, ...] (module docstring)."""
    s, r, p = schedule.stages, schedule.repeats, schedule.layers_per_chunk
    rest = w_L.shape[1:]
    return w_L.reshape(r, s, p, *rest).swapaxes(0, 1).reshape(s, r * p, *rest)


def from_stages(w_S: jax.Array, schedule: Schedule) -> jax.Array:
    """Stage weights [S, R * P, ...] back in layer order [L, ...] (the inverse of `to_stages`)."""
    s, r, p = schedule.stages, schedule.repeats, schedule.layers_per_chunk
    rest = w_S.shape[2:]
    return w_S.reshape(s, r, p, *rest).swapaxes(0, 1).reshape(s * r * p, *rest)


def to_microbatches(x_B: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], microbatch i the rows i, M + i, 2M + i, ...: strided, so each
    shard of a batch split over `data` holds its share of every microbatch (no data moves)."""
    b = x_B.shape[0]
    if b % m:
        raise ConfigError(
            f"a batch of {b} rows does not cut into pipeline.microbatches={m}; choose a divisor of "
            f"{b} (each microbatch must also split over mesh.data)."
        )
    return x_B.reshape(b // m, m, *x_B.shape[1:]).swapaxes(0, 1)


def from_microbatches(x_M: jax.Array) -> jax.Array:
    """The inverse of `to_microbatches`."""
    return x_M.swapaxes(0, 1).reshape(-1, *x_M.shape[2:])


def shift(x_S: jax.Array, mesh: Mesh) -> jax.Array:
    """Stage s's value to stage s + 1, the last stage's to stage 0: one `ppermute` (a ring)."""
    n = mesh.shape[STAGE]
    ring = [(s, (s + 1) % n) for s in range(n)]
    return jax.shard_map(
        lambda x: jax.lax.ppermute(x, STAGE, ring),
        mesh=mesh,
        in_specs=PartitionSpec(STAGE),
        out_specs=PartitionSpec(STAGE),
        axis_names={STAGE},
    )(x_S)


def _arrive(io_MX, x, stage, item, schedule: Schedule):
    """Stage 0 files `x`, the last stage's output for `item` (just arrived), in its io slot."""
    ok = (stage == 0) & (item >= 0) & (item < schedule.items)
    slot = jnp.mod(item, schedule.microbatches)
    return io_MX.at[slot].set(jnp.where(ok, x, io_MX[slot]))


# The per-stage function: (stage weights, input, the microbatch's inputs, repeat, stage)
# -> (output, side) where `side` is what a side channel records (None without one).
StageFn = Callable[..., tuple[jax.Array, jax.Array | None]]


def run(
    stage_fn: StageFn,
    weights_S,
    x_MX: jax.Array,
    inputs_M,
    schedule: Schedule,
    mesh: Mesh,
    act: tuple[str | None, ...],
    channel=None,
):
    """Runs the pipeline on microbatches `x_MX` [M, ...] (logical axes `act` after M) with
    per-microbatch `inputs_M` (a pytree of [M, ...]); returns the outputs [M, ...] and, with a
    side `channel` (`jspec.pipeline.taps.TapChannel`), what it delivered (else None)."""
    n, m = schedule.stages, schedule.microbatches
    stage_ids = jnp.arange(n)
    per_stage = lambda x: mesh_lib.constrain(x, mesh, (STAGE, *act))
    io_S = mesh_lib.constrain(jnp.broadcast_to(x_MX, (n, *x_MX.shape)), mesh, (STAGE, None, *act))
    buf_S = per_stage(jnp.zeros((n, *x_MX.shape[1:]), x_MX.dtype))
    side_S = None if channel is None else channel.empty(x_MX, mesh, act)
    remat_stage = jax.checkpoint(stage_fn, prevent_cse=False)

    def one_stage(w, buf, io, side, stage, i):
        io = _arrive(io, buf, stage, i - n, schedule)
        busy, repeat, micro = schedule.work(i, stage)
        x = jnp.where(stage == 0, io[jnp.mod(i, m)], buf)
        mb = jax.tree.map(lambda a: a[micro], inputs_M)
        out, recorded = remat_stage(w, x, mb, repeat, stage)
        if channel is not None:
            side = channel.store(side, recorded, micro, busy, repeat, stage)
        return out, io, side

    def iteration(carry, i):
        buf_S, io_S, side_S = carry
        stages = jax.vmap(one_stage, in_axes=(0, 0, 0, 0, 0, None), spmd_axis_name=STAGE)
        out_S, io_S, side_S = stages(weights_S, buf_S, io_S, side_S, stage_ids, i)
        return (shift(per_stage(out_S), mesh), io_S, side_S), None

    carry = (buf_S, io_S, side_S)
    (buf_S, io_S, side_S), _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
    last = jax.vmap(_arrive, in_axes=(0, 0, 0, None, None), spmd_axis_name=STAGE)
    io_S = last(io_S, buf_S, stage_ids, schedule.items - 1, schedule)
    delivered = None if channel is None else channel.deliver(side_S, mesh)
    return io_S[0], delivered
