"""One device's share of the work: queries against one set of keys, tile by tile, in XLA.

`fwd` continues a running result (output and log-sum-exp, float32) with the keys it is given, so
several key sets (ring steps, the branch) accumulate in one buffer, exactly as if they were one.
`bwd` is given the *global* log-sum-exp and `delta = sum(dout * out)`, so each key set's gradient
is computed on its own; dq accumulates in the buffer it is given. Tile pairs whose segment and
position ranges show that no query can see any key are skipped (`may_see`); the others are masked
exactly by `masks.visible`. No score tile larger than block_q x block_k exists at any time.

The branch-to-branch part (`branch_fwd` / `branch_bwd`) walks each query's ancestors through
`parent`, one generation per step, so its cost is the number of queries times the tree depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jspec.attention import masks

_BIG = jnp.iinfo(jnp.int32).max


class TileRanges(NamedTuple):
    """Per tile, over the non-padding tokens of every row: segment range and position range."""

    seg_lo: Int[Array, " n"]
    seg_hi: Int[Array, " n"]
    pos_lo: Int[Array, " n"]
    pos_hi: Int[Array, " n"]


def tile_ranges(segment_ids: Int[Array, "b t"], positions: Int[Array, "b t"], block: int):
    b, t = segment_ids.shape
    seg = segment_ids.reshape(b, t // block, block)
    pos = positions.reshape(b, t // block, block)
    real = seg != 0
    return TileRanges(
        seg_lo=jnp.where(real, seg, _BIG).min(axis=(0, 2)),
        seg_hi=jnp.where(real, seg, -1).max(axis=(0, 2)),
        pos_lo=jnp.where(real, pos, _BIG).min(axis=(0, 2)),
        pos_hi=jnp.where(real, pos, -_BIG).max(axis=(0, 2)),
    )


def may_see(q: TileRanges, k: TileRanges) -> Array:
    """False only when no query of the q tile can see any key of the k tile (sound, cheap)."""
    return (q.seg_lo <= k.seg_hi) & (k.seg_lo <= q.seg_hi) & (k.pos_lo <= q.pos_hi)


def tile_visibility(
    q_seg: Int[Array, "b tq"],
    q_pos: Int[Array, "b tq"],
    k_seg: Int[Array, "b tk"],
    k_pos: Int[Array, "b tk"],
    block_q: int,
    block_k: int,
) -> tuple[Bool[Array, "b nq nk"], Bool[Array, "b nq nk"]]:
    """Per row and (query tile, key tile): whether some query may see some key (`may_see` on the
    row's own ranges), and whether every query sees every key (one segment, no padding, keys
    before queries: the tile needs no mask). The Pallas kernels' plans are made of these."""

    def ranges(seg, pos, block):
        r = jax.vmap(lambda s, p: tile_ranges(s[None], p[None], block))(seg, pos)
        return r, (seg.reshape(seg.shape[0], -1, block) == 0).any(-1)

    qr, qpad = ranges(q_seg, q_pos, block_q)
    kr, kpad = ranges(k_seg, k_pos, block_k)
    qe = TileRanges(*(x[:, :, None] for x in qr))
    ke = TileRanges(*(x[:, None, :] for x in kr))
    see = may_see(qe, ke)
    full = (
        see
        & ~qpad[:, :, None]
        & ~kpad[:, None, :]
        & (qe.seg_lo == qe.seg_hi)
        & (ke.seg_lo == ke.seg_hi)
        & (qe.seg_lo == ke.seg_lo)
        & (ke.pos_hi <= qe.pos_lo)
    )
    return see, full


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_rows(x, length: int):
    """Pads axis 1 with zeros to `length` (segment id 0: padding sees and is seen by nothing)."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def empty_acc(q: Float[Array, "b tq hq d"]):
    """The running (output, lse) of queries that have seen nothing yet: (0, -inf), float32."""
    return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)


def _finish(m, l, acc):
    """Online-softmax state -> (normalised output, lse); a query that saw nothing: (0, -inf)."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    return acc / l_safe[..., None], jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def _tiles(x, block):
    """[B, T, ...] -> [T // block, B, block, ...]."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def _untiles(x):
    """[n, B, block, ...] -> [B, n * block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _grouped(q, hkv):
    """[..., Hq, D] -> [..., Hkv, G, D] (GQA: G query heads share one KV head)."""
    return q.reshape(*q.shape[:-2], hkv, q.shape[-2] // hkv, q.shape[-1])


def _grouped_heads(x, hkv):
    """[..., Hq] -> [..., Hkv, G]: per-head statistics (lse, delta) in the grouped layout."""
    return x.reshape(*x.shape[:-1], hkv, x.shape[-1] // hkv)


def _scores(q_i, k_j, qseg, qpos, kseg, kpos, scale):
    """Masked scores [B, Hkv, G, bq, bk] (float32) of one tile pair, and the mask."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    mask = masks.visible(qseg[:, :, None], qpos[:, :, None], kseg[:, None], kpos[:, None])
    mask = mask[:, None, None]
    return jnp.where(mask, s, -jnp.inf), mask


def fwd(
    q: Float[Array, "b tq hq d"],
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    q_seg: Int[Array, "b tq"],
    q_pos: Int[Array, "b tq"],
    k_seg: Int[Array, "b tk"],
    k_pos: Int[Array, "b tk"],
    acc: tuple[Float[Array, "b tq hq d"], Float[Array, "b tq hq"]] | None = None,
    *,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Float[Array, "b tq hq d"], Float[Array, "b tq hq"]]:
    """Output (float32, normalised) and log-sum-exp of q against k, v and whatever `acc` = (o,
    lse) already holds (None: nothing; lse -inf: nothing yet for that query). Tq, Tk divide the
    blocks."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    acc = acc or empty_acc(q)
    kr = tile_ranges(k_seg, k_pos, block_k)
    k_xs = (_tiles(k, block_k), _tiles(v, block_k), _tiles(k_seg, block_k), _tiles(k_pos, block_k))

    def one_q_tile(q_args):
        q_i, qseg, qpos, qr, o_i, lse_i = q_args

        def step(carry, k_args):
            k_j, v_j, kseg, kpos, kr_j = k_args

            def attend(carry):
                m, l, acc = carry
                s, _ = _scores(q_i, k_j, qseg, qpos, kseg, kpos, scale)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                pv = jnp.einsum(
                    "bhgqk,bkhd->bhgqd",
                    p.astype(v_j.dtype),
                    v_j,
                    preferred_element_type=jnp.float32,
                )
                return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

            carry = jax.lax.cond(may_see(qr, kr_j), attend, lambda c: c, carry)
            return carry, None

        # The running (o, lse) as online-softmax state: m = lse, l = 1 (0 if empty), acc = o.
        lse_t = jnp.moveaxis(lse_i, 1, 3)  # [B, Hkv, G, bq]
        init = (lse_t, jnp.isfinite(lse_t).astype(jnp.float32), jnp.moveaxis(o_i, 1, 3))
        (m, l, acc), _ = jax.lax.scan(step, init, (*k_xs, kr))
        o, lse = _finish(m, l, acc)
        # [B, Hkv, G, bq, (D)] -> [B, bq, Hq, (D)]
        o = jnp.moveaxis(o, 3, 1).reshape(b, block_q, hq, d)
        lse = jnp.moveaxis(lse, 3, 1).reshape(b, block_q, hq)
        return o, lse

    qr = tile_ranges(q_seg, q_pos, block_q)
    q_xs = (
        _tiles(_grouped(q, hkv), block_q),
        _tiles(q_seg, block_q),
        _tiles(q_pos, block_q),
        qr,
        _tiles(_grouped(acc[0], hkv), block_q),
        _tiles(_grouped_heads(acc[1], hkv), block_q),
    )
    o, lse = jax.lax.map(one_q_tile, q_xs)
    return _untiles(o), _untiles(lse)


def _tile_grads(q_i, k_j, v_j, qseg, qpos, kseg, kpos, lse_i, do_i, delta_i, scale):
    """One (q tile, k tile) pair of the backward: its dq, dk and dv contributions (float32)."""
    heads_first = lambda x: jnp.moveaxis(x, 1, 3)  # [B, bq, Hkv, G] -> [B, Hkv, G, bq]
    s, mask = _scores(q_i, k_j, qseg, qpos, kseg, kpos, scale)
    lse_t = heads_first(lse_i)
    lse_safe = jnp.where(jnp.isfinite(lse_t), lse_t, 0.0)
    p = jnp.where(mask, jnp.exp(s - lse_safe[..., None]), 0.0)
    f32 = dict(preferred_element_type=jnp.float32)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do_i.dtype), do_i, **f32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, **f32)
    ds = (p * (dp - heads_first(delta_i)[..., None]) * scale).astype(q_i.dtype)
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j, **f32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_i, **f32)
    return dq, dk, dv


def bwd(
    q: Float[Array, "b tq hq d"],
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    q_seg: Int[Array, "b tq"],
    q_pos: Int[Array, "b tq"],
    k_seg: Int[Array, "b tk"],
    k_pos: Int[Array, "b tk"],
    lse: Float[Array, "b tq hq"],
    dout: Float[Array, "b tq hq d"],
    delta: Float[Array, "b tq hq"],
    dq: Float[Array, "b tq hq d"] | None = None,
    *,
    scale: float,
    block_q: int,
    block_k: int,
):
    """Gradients (float32) of q, k, v for this key set, given the global lse and delta; dq is
    added to the `dq` given (None: zeros)."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]

    qr = tile_ranges(q_seg, q_pos, block_q)
    q_xs = (
        _tiles(_grouped(q, hkv), block_q),
        _tiles(q_seg, block_q),
        _tiles(q_pos, block_q),
        _tiles(_grouped_heads(lse, hkv), block_q),
        _tiles(_grouped(dout, hkv), block_q),
        _tiles(_grouped_heads(delta, hkv), block_q),
        qr,
    )

    def one_k_tile(dq_acc, k_args):
        k_j, v_j, kseg, kpos, kr_j = k_args

        def step(carry, q_args):
            q_i, qseg, qpos, lse_i, do_i, delta_i, qr_i = q_args

            def grads(carry):
                dk_j, dv_j = carry
                tile = (q_i, k_j, v_j, qseg, qpos, kseg, kpos, lse_i, do_i, delta_i)
                dq_i, dk, dv = _tile_grads(*tile, scale)
                return (dk_j + dk, dv_j + dv), dq_i

            def skip(carry):
                return carry, jnp.zeros_like(q_i, jnp.float32)

            return jax.lax.cond(may_see(qr_i, kr_j), grads, skip, carry)

        zeros = jnp.zeros_like(k_j, jnp.float32)
        (dk_j, dv_j), dq_tiles = jax.lax.scan(step, (zeros, zeros), q_xs)
        return dq_acc + dq_tiles, (dk_j, dv_j)

    kr = tile_ranges(k_seg, k_pos, block_k)
    k_xs = (
        _tiles(k, block_k),
        _tiles(v, block_k),
        _tiles(k_seg, block_k),
        _tiles(k_pos, block_k),
        kr,
    )
    dq0 = jnp.zeros_like(q, jnp.float32) if dq is None else dq
    dq0 = _tiles(_grouped(dq0, hkv), block_q)
    dq, (dk, dv) = jax.lax.scan(one_k_tile, dq0, k_xs)
    return _untiles(dq).reshape(b, tq, hq, d), _untiles(dk), _untiles(dv)


# ---------------------------------------------------------------------------------------------
# Branch to branch: each query sees its node and the node's ancestors.


def gather_rows(x, idx):
    """x [B, N, ...] at idx [B, M] (clamped) -> [B, M, ...]."""
    idx = jnp.maximum(idx, 0)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _walk(nodes, parent, body, init):
    """Runs body(carry, cur) for cur = node, parent(node), ... until every walk has left the tree.

    At most N generations, so a cycle in `parent` cannot hang the loop.
    """
    n = parent.shape[1]

    def cond(state):
        i, cur, _ = state
        return (i < n) & jnp.any(cur >= 0)

    def step(state):
        i, cur, carry = state
        carry = body(carry, cur)
        up = jnp.where(cur >= 0, gather_rows(parent, cur), -1)
        return i + 1, up, carry

    return jax.lax.while_loop(cond, step, (0, nodes, init))[2]


def branch_fwd(
    q: Float[Array, "b nq hq d"],
    k: Float[Array, "b n hkv d"],
    v: Float[Array, "b n hkv d"],
    nodes: Int[Array, "b nq"],
    parent: Int[Array, "b n"],
    *,
    scale: float,
):
    """Output (float32) and lse of each branch query against its node and the node's ancestors.

    `nodes` is -1 for queries that see no branch key (padding).
    """
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    qg = _grouped(q, hkv)

    def body(carry, cur):
        m, l, acc = carry
        s = jnp.einsum(
            "bqhgd,bqhd->bqhg", qg, gather_rows(k, cur), preferred_element_type=jnp.float32
        )
        s = jnp.where((cur >= 0)[:, :, None, None], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, s)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe)
        corr = jnp.exp(m - m_safe)
        pv = p[..., None] * gather_rows(v, cur)[:, :, :, None].astype(jnp.float32)
        return m_new, l * corr + p, acc * corr[..., None] + pv

    init = (
        jnp.full_like(qg[..., 0], -jnp.inf, jnp.float32),
        jnp.zeros_like(qg[..., 0], jnp.float32),
        jnp.zeros_like(qg, jnp.float32),
    )
    m, l, acc = _walk(nodes, parent, body, init)
    o, lse = _finish(m, l, acc)
    return o.reshape(b, nq, hq, d), lse.reshape(b, nq, hq)


def branch_bwd(q, k, v, nodes, parent, lse, dout, delta, *, scale: float):
    """Gradients (float32) of the branch queries, keys and values, given the global lse, delta."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    qg = _grouped(q, hkv).astype(jnp.float32)
    do = _grouped(dout, hkv).astype(jnp.float32)
    lse_g = _grouped_heads(lse, hkv)
    lse_safe = jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)
    delta_g = _grouped_heads(delta, hkv)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], nodes.shape)

    def body(carry, cur):
        dq, dk, dv = carry
        live = (cur >= 0)[:, :, None, None]
        k_c = gather_rows(k, cur).astype(jnp.float32)[:, :, :, None]
        v_c = gather_rows(v, cur).astype(jnp.float32)[:, :, :, None]
        s = jnp.sum(qg * k_c, axis=-1) * scale
        p = jnp.where(live, jnp.exp(s - lse_safe), 0.0)
        dp = jnp.sum(do * v_c, axis=-1)
        ds = p * (dp - delta_g) * scale
        dq = dq + ds[..., None] * k_c
        slot = jnp.maximum(cur, 0)
        dk = dk.at[rows, slot].add(jnp.sum(ds[..., None] * qg, axis=3))
        dv = dv.at[rows, slot].add(jnp.sum(p[..., None] * do, axis=3))
        return dq, dk, dv

    init = (
        jnp.zeros_like(qg),
        jnp.zeros_like(k, jnp.float32),
        jnp.zeros_like(v, jnp.float32),
    )
    dq, dk, dv = _walk(nodes, parent, body, init)
    return dq.reshape(b, nq, hq, d), dk, dv
