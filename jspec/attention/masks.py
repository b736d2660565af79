"""Who sees whom: the visibility rules of the contract, shared by every backend.

Trunk rule: query (q_seg, q_pos) sees key (k_seg, k_pos) iff k_seg == q_seg != 0 and k_pos <= q_pos.
A branch query takes the segment and position of its node's anchor for the trunk rule, and sees the
branch keys of its node and the node's ancestors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def visible(q_seg: Array, q_pos: Array, k_seg: Array, k_pos: Array) -> Array:
    """The trunk rule, elementwise with broadcasting."""
    return (q_seg == k_seg) & (q_seg != 0) & (k_pos <= q_pos)


def anchor_segments(
    segment_ids: Int[Array, "b t"], positions: Int[Array, "b t"], anchor: Int[Array, "b n"]
) -> tuple[Int[Array, "b n"], Int[Array, "b n"]]:
    """Segment and position each branch node inherits from its anchor (segment 0 when anchor=-1)."""
    idx = jnp.maximum(anchor, 0)
    seg = jnp.take_along_axis(segment_ids, idx, axis=1)
    pos = jnp.take_along_axis(positions, idx, axis=1)
    return jnp.where(anchor >= 0, seg, 0), pos


def ancestor_mask(parent: Int[Array, "b n"]) -> Bool[Array, "b n n"]:
    """mask[b, i, j]: node j is node i or one of its ancestors. Dense: for small trees and tests.

    By pointer jumping: after round r, row i holds i's ancestors up to 2**r levels up and `up`
    i's ancestor 2**r levels up, so log2(N) rounds of row gathers suffice (XLA makes them one or
    two kernels; squaring the matrix takes a product and a conversion a round)."""
    n = parent.shape[1]
    reach = jnp.eye(n, dtype=bool) | (parent[..., None] == jnp.arange(n))  # -1 matches nothing
    rows = jax.vmap(lambda x, i: x[i])  # rows[b, i] = x[b, index[b, i]]
    up = parent
    for _ in range(max(n - 1, 1).bit_length()):
        has_up = up >= 0
        reach = reach | (rows(reach, jnp.maximum(up, 0)) & has_up[..., None])
        up = jnp.where(has_up, rows(up, jnp.maximum(up, 0)), -1)
    return reach
