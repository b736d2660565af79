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
    """mask[b, i, j]: node j is node i or one of its ancestors. Dense: for small trees and tests."""
    n = parent.shape[1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), parent.shape + (n,))
    reach = eye | jax.nn.one_hot(parent, n, dtype=bool)  # -1 gives a zero row
    for _ in range(max(n - 1, 1).bit_length()):  # each squaring doubles the path length covered
        reach = jnp.einsum("bik,bkj->bij", reach.astype(jnp.float32), reach.astype(jnp.float32)) > 0
    return reach
