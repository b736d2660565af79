"""Dense masked attention: the semantics of the contract, written for clarity, not size.

Every backend is tested against this. It materialises the whole score matrix, so keep it to small
shapes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jspec.attention import masks
from jspec.attention.branch import Branch


def _softmax_attend(q, k, v, mask, scale):
    """q [B,Q,Hq,D], k/v [B,K,Hkv,D], mask [B,Q,K] -> out [B,Q,Hq,D] (f32); empty rows give 0."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, nq, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, nq, hq, d)


def reference_attention(
    q: Float[Array, "b tq hq d"] | None,
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    segment_ids: Int[Array, "b tk"],
    positions: Int[Array, "b tk"],
    *,
    q_segment_ids: Int[Array, "b tq"] | None = None,
    q_positions: Int[Array, "b tq"] | None = None,
    branch: Branch | None = None,
    scale: float | None = None,
):
    """Same signature and results as `jspec.attention.attention`, by one dense softmax."""
    d = k.shape[-1]
    scale = d**-0.5 if scale is None else scale
    if q_segment_ids is None:
        q_segment_ids, q_positions = segment_ids, positions
    out = None
    if q is not None:
        mask = masks.visible(
            q_segment_ids[:, :, None],
            q_positions[:, :, None],
            segment_ids[:, None],
            positions[:, None],
        )
        out = _softmax_attend(q, k, v, mask, scale).astype(q.dtype)
    if branch is None:
        return out

    nodes = branch.nodes()
    seg_b, pos_b = masks.anchor_segments(segment_ids, positions, branch.anchor)
    q_seg = jnp.take_along_axis(seg_b, nodes, axis=1)
    q_pos = jnp.take_along_axis(pos_b, nodes, axis=1)
    trunk_mask = masks.visible(
        q_seg[:, :, None], q_pos[:, :, None], segment_ids[:, None], positions[:, None]
    )
    anc = masks.ancestor_mask(branch.parent)  # [B, N, N]
    branch_mask = jnp.take_along_axis(anc, nodes[:, :, None], axis=1) & (q_seg[:, :, None] != 0)
    keys = jnp.concatenate([k, branch.k.astype(k.dtype)], axis=1)
    values = jnp.concatenate([v, branch.v.astype(v.dtype)], axis=1)
    mask = jnp.concatenate([trunk_mask, branch_mask], axis=-1)
    branch_out = _softmax_attend(branch.q, keys, values, mask, scale).astype(branch.q.dtype)
    return out, branch_out
