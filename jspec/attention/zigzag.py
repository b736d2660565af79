"""Per-document zigzag layout of packed rows, so causal work is balanced across the ring.

Every document (a run of equal segment ids, padding included) is cut into 2 * cp chunks; rank r
holds chunks r and 2 * cp - 1 - r of every document, in document order. A document near the start
of a row costs little and one near the end costs much, but each rank gets one cheap and one dear
chunk of each, so every rank does the same causal work. Each document's length must be a multiple
of 2 * cp (the packer pads them).

The sharded row is rank-major: slots [r * T / cp, (r + 1) * T / cp) belong to rank r, so sharding
the permuted row over the context axis gives each rank its own tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jspec.attention import explicit


def _runs(segment_ids: Int[Array, "b t"]):
    """Start and length of the run of equal segment ids each token belongs to."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    first = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
    last = jnp.concatenate([first[:, 1:], jnp.ones((b, 1), bool)], axis=1)
    stop = jax.lax.cummin(jnp.where(last, idx + 1, t), axis=1, reverse=True)
    return start, stop - start


def zigzag_destination(segment_ids: Int[Array, "b t"] | None, t: int, cp: int) -> Int[Array, "b t"]:
    """dest[b, i]: the slot of the sharded row that natural token i moves to."""
    if segment_ids is None:
        segment_ids = jnp.ones((1, t), jnp.int32)
    start, length = _runs(segment_ids)
    # A row with a misaligned document (only possible under `jit`: see `mark_misaligned`) is laid
    # out as one document, so the layout is a permutation still and the mistake stays in its row.
    whole = _misaligned(length, cp)[:, None]
    start, length = jnp.where(whole, 0, start), jnp.where(whole, t, length)
    chunk = length // (2 * cp)
    offset = jnp.arange(t, dtype=jnp.int32) - start
    c = offset // jnp.maximum(chunk, 1)
    rank = jnp.where(c < cp, c, 2 * cp - 1 - c)
    local = start // cp + jnp.where(c < cp, 0, chunk) + offset % jnp.maximum(chunk, 1)
    return rank * (t // cp) + local


def _source(dest):
    b, t = dest.shape
    rows = jnp.arange(b)[:, None]
    return jnp.zeros_like(dest).at[rows, dest].set(jnp.arange(t, dtype=dest.dtype))


def _permute(x, index):
    """x[b, index[b, i]] along axis 1; an Explicit-sharded x keeps its sharding."""

    def take(x, index):
        index = jnp.broadcast_to(index, (x.shape[0], index.shape[1]))
        return (jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1),)

    return explicit.run_auto(take, (x, index), like=(x,))[0]


def zigzag_shard(x: Array, segment_ids: Int[Array, "b t"] | None, cp: int) -> Array:
    """Natural-order rows [B,T,...] -> zigzag rank-major rows (shard axis 1 over cp ranks).

    `segment_ids` None means one document per row (a static permutation).
    """
    return _permute(x, _source(zigzag_destination(segment_ids, x.shape[1], cp)))


def zigzag_unshard(x: Array, segment_ids: Int[Array, "b t"] | None, cp: int) -> Array:
    """The inverse of `zigzag_shard` (`segment_ids` are the natural-order ones)."""
    return _permute(x, zigzag_destination(segment_ids, x.shape[1], cp))


def concrete(*xs) -> bool:
    """Whether every array is a value this process can read, so checks can read it: not abstract
    under `jit`, and not spread over other hosts' devices (a multi-process global array)."""
    return not any(
        isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True) for x in xs
    )


def _misaligned(length: Int[Array, "b t"], cp: int) -> Bool[Array, " b"]:
    return jnp.any(length % (2 * cp) != 0, axis=1)


def mark_misaligned(x: Array, segment_ids: Int[Array, "b t"], cp: int) -> Array:
    """x [B, ...] with NaN in every row that holds a document whose length is not a multiple of
    2 * cp.

    For ids known only inside `jit`, where `check_alignment` cannot read them: such a row fails
    loudly instead of attending over a scrambled layout, and the other rows are untouched (their
    outputs and gradients are exact; the marked row's gradients are zero).
    """
    bad = _misaligned(_runs(segment_ids)[1], cp)
    return jnp.where(bad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x)


def check_alignment(segment_ids, cp: int) -> None:
    """A clear error for a row or document whose length is not a multiple of 2 * cp.

    The row length is checked always; the documents when the ids are concrete values (under `jit`
    they are abstract: see `mark_misaligned`).
    """
    t = segment_ids.shape[1]
    if t % (2 * cp):
        raise ValueError(
            f"sequence length {t} is not a multiple of 2 * cp = {2 * cp}; pad rows to a multiple "
            f"of {2 * cp} for context parallelism of {cp}."
        )
    if not concrete(segment_ids):
        return
    seg = np.asarray(segment_ids)
    for row in range(seg.shape[0]):
        cuts = np.flatnonzero(np.diff(seg[row])) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [t]])
        for start, stop in zip(starts, stops, strict=True):
            if (stop - start) % (2 * cp):
                raise ValueError(
                    f"document with segment id {seg[row, start]} in row {row} (tokens "
                    f"{start}..{stop - 1}, length {stop - start}) is not a multiple of "
                    f"2 * cp = {2 * cp}; pad every document to a multiple of {2 * cp} when "
                    "packing for context parallelism."
                )
