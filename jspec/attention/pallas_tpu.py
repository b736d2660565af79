"""The block kernel on TPUs: `blocks.fwd` / `blocks.bwd` as Pallas TPU (Mosaic) kernels.

Same signatures and results as `blocks.fwd` and `blocks.bwd`, so `ring.py` can call either, and
the same tile pairs, masks and skipping as the GPU kernel (`pallas_gpu`): the visibility rule
(`masks.visible`) is evaluated in VMEM from segment ids and positions, and tiles nobody sees are
never fetched.

Skipping. Mosaic runs a program's grid in order on one core, with the next block's DMA
overlapping the current block's compute, so a program's inner loop is a grid axis whose block
index comes from a plan in scalar memory (`PrefetchScalarGridSpec`): per row and outer tile, the
inner tiles that some query may see (`blocks.tile_visibility`), in order, each with a flag for
"fully visible" (no mask needed), then the last one repeated, which the pipeline does not fetch
again and the kernel skips. The online-softmax state (or the gradient accumulators) lives in VMEM
scratch across the inner axis.

Kernels (flash-attention 2, heads-major layouts so that every block spans (tile, head dim)):
- forward: grid (row, query head, query tile, key tile), continuing the running (o, lse);
- dK/dV: grid (row, KV head, key tile, query head of the group, query tile): the G query heads
  of a KV head accumulate in one scratch, so GQA needs no reduction afterwards;
- dQ: grid (row, query head, query tile, key tile).
Tiles: `Tiles` (queries, keys); on a TPU the key tile is a multiple of 128 (a lane tile: the key
segment ids and positions are lane vectors) and the query tile a multiple of 8. `interpret=True`
runs the kernels in Pallas' interpreter on any backend (tests on the CPU); `jspec.jobs.plan
--topology` compiles them for TPU slices. No TPU has run them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, masks, target

_SQ = pl.squeezed


class Tiles(NamedTuple):
    """Rows of queries and of keys a program's block holds."""

    q: int = 128
    k: int = 128


TILES = Tiles()


def available() -> bool:
    """Whether programs are traced for a TPU (`target.device()`), where 'auto' takes these
    kernels."""
    return target.platform() == "tpu"


_NT, _NN, _TN = ((((1,), (1,)), ((), ())), (((1,), (0,)), ((), ())), (((0,), (0,)), ((), ())))


def _dot(a, b, dims):
    """a @ b.T (_NT), a @ b (_NN) or a.T @ b (_TN), accumulated in float32."""
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def fold(q, scale, m_sc, l_sc, acc_sc, k, v, seen):
    """Online softmax: keys k and values v [C, D] folded into the scratch state (m, l [T, 1],
    acc [T, D]) of the queries q [T, D], where `seen` [T, C] (None: everywhere)."""
    s = _dot(q, k, _NT) * scale
    if seen is not None:
        s = jnp.where(seen, s, -jnp.inf)
    m = m_sc[...]
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: p = 0 below
    p = jnp.exp(s - m_use)
    corr = jnp.exp(m - m_use)
    pv = _dot(p.astype(v.dtype), v, _NN)
    m_sc[...] = m_new
    l_sc[...] = l_sc[...] * corr + p.sum(axis=-1, keepdims=True)
    acc_sc[...] = acc_sc[...] * corr + pv


# ---------------------------------------------------------------------------------------------
# The plan: per (row, outer tile), the inner tiles to visit.


def _plan(q_seg, q_pos, k_seg, k_pos, tiles: Tiles, *, by_key: bool):
    """(count [B * n_outer], visits [B * n_outer * n_inner]) int32, flat for scalar memory.

    visits of one outer tile: inner tile << 1 | (1 if fully visible), the visible tiles in order,
    then the last of them repeated (tile 0 where none is visible) up to n_inner."""
    see, full = blocks.tile_visibility(q_seg, q_pos, k_seg, k_pos, tiles.q, tiles.k)
    if by_key:
        see, full = jnp.swapaxes(see, 1, 2), jnp.swapaxes(full, 1, 2)
    n = see.shape[-1]
    order = jnp.argsort((~see).astype(jnp.int32), axis=-1, stable=True).astype(jnp.int32)
    count = see.sum(-1, dtype=jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    order = jnp.where(jnp.arange(n) < count[..., None], order, last)
    visits = 2 * order + jnp.take_along_axis(full, order, axis=-1).astype(jnp.int32)
    return count.reshape(-1), visits.reshape(-1)


def _visit(count_ref, visits_ref, outer, inner, n_inner, body):
    """body(seen_needed) for the program's inner step `inner` of outer index `outer`, if live."""
    v = visits_ref[outer * n_inner + inner]
    live = inner < count_ref[outer]

    @pl.when(live & ((v & 1) == 1))
    def _():
        body(False)

    @pl.when(live & ((v & 1) == 0))
    def _():
        body(True)


def _seen(qseg_ref, qpos_ref, kseg_ref, kpos_ref):
    """The tile's mask [Tq, Tk]: query ids are columns [Tq, 1], key ids rows [1, Tk]."""
    return masks.visible(qseg_ref[...], qpos_ref[...], kseg_ref[...], kpos_ref[...])


# ---------------------------------------------------------------------------------------------
# Kernels.


def _fwd_kernel(count_ref, visits_ref, *refs, scale, n_q, n_k):
    q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref, o0_ref, lse0_ref = refs[:9]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[9:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)  # the running (o, lse) as online-softmax state: m = lse, l = 1, acc = o
    def _():
        lse0 = lse0_ref[...]
        m_sc[...] = lse0
        l_sc[...] = jnp.where(lse0 == -jnp.inf, 0.0, 1.0)
        acc_sc[...] = o0_ref[...]

    def body(masked):
        seen = _seen(qseg_ref, qpos_ref, kseg_ref, kpos_ref) if masked else None
        fold(q_ref[...], scale, m_sc, l_sc, acc_sc, k_ref[...], v_ref[...], seen)

    _visit(count_ref, visits_ref, b * n_q + i, j, n_k, body)

    @pl.when(j == n_k - 1)
    def _():
        l = l_sc[...]
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = acc_sc[...] / l_safe
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(l_safe), -jnp.inf)


def _probabilities(q, k, lse, scale, seen):
    """p [Tq, Tk] of a tile under the global lse [Tq, 1] (a query that sees nothing: lse -inf)."""
    s = _dot(q, k, _NT)
    p = jnp.exp(s * scale - jnp.where(lse == -jnp.inf, 0.0, lse))
    return p if seen is None else jnp.where(seen, p, 0.0)


def _dkdv_kernel(count_ref, visits_ref, *refs, scale, n_k, n_q, groups):
    q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref, lse_ref, do_ref, delta_ref = refs[
        :10
    ]
    dk_ref, dv_ref, dk_sc, dv_sc = refs[10:]
    b, kj, g, j = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (j == 0))
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def body(masked):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        do = do_ref[...].astype(q.dtype)
        seen = _seen(qseg_ref, qpos_ref, kseg_ref, kpos_ref) if masked else None
        p = _probabilities(q, k, lse_ref[...], scale, seen)
        dv_sc[...] += _dot(p.astype(do.dtype), do, _TN)
        ds = p * (_dot(do, v, _NT) - delta_ref[...])
        dk_sc[...] += _dot(ds.astype(q.dtype), q, _TN)

    _visit(count_ref, visits_ref, b * n_k + kj, j, n_q, body)

    @pl.when((g == groups - 1) & (j == n_q - 1))
    def _():
        dk_ref[...] = dk_sc[...] * scale
        dv_ref[...] = dv_sc[...]


def _dq_kernel(count_ref, visits_ref, *refs, scale, n_q, n_k):
    q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref, lse_ref, do_ref, delta_ref = refs[
        :10
    ]
    dq0_ref, dq_ref, dq_sc = refs[10:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def body(masked):
        q, k = q_ref[...], k_ref[...]
        do = do_ref[...].astype(q.dtype)
        seen = _seen(qseg_ref, qpos_ref, kseg_ref, kpos_ref) if masked else None
        p = _probabilities(q, k, lse_ref[...], scale, seen)
        ds = p * (_dot(do, v_ref[...], _NT) - delta_ref[...])
        dq_sc[...] += _dot(ds.astype(k.dtype), k, _NN)

    _visit(count_ref, visits_ref, b * n_q + i, j, n_k, body)

    @pl.when(j == n_k - 1)
    def _():
        dq_ref[...] = dq0_ref[...] + dq_sc[...] * scale


# ---------------------------------------------------------------------------------------------
# Wrappers: layouts, padding, the plans, the calls.


def _check(q, k, tiles: Tiles, interpret: bool):
    if not isinstance(tiles, Tiles):
        raise TypeError(f"the TPU kernel takes pallas_tpu.Tiles; got {tiles!r}.")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}.")
    if tiles.q % 8 or tiles.k % 8:
        raise ValueError(f"tiles must be multiples of 8; got {tiles}.")
    if not interpret and tiles.k % 128:
        raise ValueError(f"on a TPU the key tile must be a multiple of 128; got {tiles}.")


class _Layout(NamedTuple):
    """The kernels' inputs: heads-major tensors, padded to whole tiles, query ids as columns
    [B, T, 1] and key ids as rows [B, 1, T] (the tile's mask is their broadcast)."""

    q: Array  # [B, Hq, Tq, D]
    k: Array  # [B, Hkv, Tk, D]
    v: Array
    q_ids: tuple[Array, Array]
    k_ids: tuple[Array, Array]


def _layout(q, k, v, q_seg, q_pos, k_seg, k_pos, tiles: Tiles) -> _Layout:
    tq, tk = blocks.round_up(q.shape[1], tiles.q), blocks.round_up(k.shape[1], tiles.k)
    heads_major = lambda x, t: jnp.swapaxes(blocks.pad_rows(x, t), 1, 2)
    return _Layout(
        heads_major(q, tq),
        heads_major(k, tk),
        heads_major(v, tk),
        tuple(blocks.pad_rows(x, tq)[:, :, None] for x in (q_seg, q_pos)),
        tuple(blocks.pad_rows(x, tk)[:, None, :] for x in (k_seg, k_pos)),
    )


def _ids(x: _Layout):
    """The padded (q_seg, q_pos, k_seg, k_pos) [B, T] of a layout, for the plans."""
    return x.q_ids[0][..., 0], x.q_ids[1][..., 0], x.k_ids[0][:, 0], x.k_ids[1][:, 0]


def _per_query(x, tq):
    """[B, T, Hq(, D)] float32 -> heads-major [B, Hq, Tq, D or 1], padded."""
    x = blocks.pad_rows(x.astype(jnp.float32), tq)
    return jnp.swapaxes(x if x.ndim == 4 else x[..., None], 1, 2)


def _call(kernel, name, grid, in_specs, out_specs, out_shapes, scratch, plan, inputs, interpret):
    """The kernel's pallas_call: float32 outputs of `out_shapes`, typed as varying over the mesh
    axes its inputs vary over (a shard_map with check_vma asks), and float32 VMEM `scratch`."""
    inner = ("arbitrary",) * (len(grid) - 3)
    mat = jax.typeof(inputs[0]).mat
    out_shape = [jax.ShapeDtypeStruct(s, jnp.float32, manual_axis_type=mat) for s in out_shapes]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(s, jnp.float32) for s in scratch],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", *inner)
        ),
        interpret=interpret,
        name=name,
    )(*plan, *inputs)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _fwd(q, k, v, q_seg, q_pos, k_seg, k_pos, o0, lse0, *, scale, tiles, interpret):
    b, tq0, hq, d = q.shape
    g = hq // k.shape[2]
    x = _layout(q, k, v, q_seg, q_pos, k_seg, k_pos, tiles)
    tq, tk = x.q.shape[2], x.k.shape[2]
    n_q, n_k = tq // tiles.q, tk // tiles.k
    plan = _plan(*_ids(x), tiles, by_key=False)
    key = lambda r, i, j, visits: visits[(r * n_q + i) * n_k + j] >> 1
    q_spec = pl.BlockSpec((_SQ, _SQ, tiles.q, d), lambda r, h, i, j, c, vs: (r, h, i, 0))
    kv_spec = pl.BlockSpec(
        (_SQ, _SQ, tiles.k, d), lambda r, h, i, j, c, vs: (r, lax.div(h, g), key(r, i, j, vs), 0)
    )
    qtok = pl.BlockSpec((_SQ, tiles.q, 1), lambda r, h, i, j, c, vs: (r, i, 0))
    ktok = pl.BlockSpec((_SQ, 1, tiles.k), lambda r, h, i, j, c, vs: (r, 0, key(r, i, j, vs)))
    stat = pl.BlockSpec((_SQ, _SQ, tiles.q, 1), lambda r, h, i, j, c, vs: (r, h, i, 0))
    o, lse = _call(
        functools.partial(_fwd_kernel, scale=scale, n_q=n_q, n_k=n_k),
        "jspec_attention_fwd_tpu",
        (b, hq, n_q, n_k),
        [q_spec, kv_spec, kv_spec, qtok, qtok, ktok, ktok, q_spec, stat],
        [q_spec, stat],
        [(b, hq, tq, d), (b, hq, tq, 1)],
        [(tiles.q, 1), (tiles.q, 1), (tiles.q, d)],
        plan,
        (x.q, x.k, x.v, *x.q_ids, *x.k_ids, _per_query(o0, tq), _per_query(lse0, tq)),
        interpret,
    )
    return jnp.swapaxes(o, 1, 2)[:, :tq0], jnp.swapaxes(lse[..., 0], 1, 2)[:, :tq0]


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _bwd(q, k, v, q_seg, q_pos, k_seg, k_pos, lse, dout, delta, dq0, *, scale, tiles, interpret):
    b, tq0, hq, d = q.shape
    tk0, hkv = k.shape[1:3]
    g = hq // hkv
    x = _layout(q, k, v, q_seg, q_pos, k_seg, k_pos, tiles)
    tq, tk = x.q.shape[2], x.k.shape[2]
    n_q, n_k = tq // tiles.q, tk // tiles.k
    do = jnp.swapaxes(blocks.pad_rows(dout, tq), 1, 2)
    lse, delta = _per_query(lse, tq), _per_query(delta, tq)
    inputs = (x.q, x.k, x.v, *x.q_ids, *x.k_ids, lse, do, delta)

    # dK, dV: grid (row, KV head, key tile, query head of the group, query tile).
    qt = lambda r, kj, j, vs: vs[(r * n_k + kj) * n_q + j] >> 1
    q_spec = pl.BlockSpec(
        (_SQ, _SQ, tiles.q, d), lambda r, h, kj, gi, j, c, vs: (r, h * g + gi, qt(r, kj, j, vs), 0)
    )
    stat = pl.BlockSpec(
        (_SQ, _SQ, tiles.q, 1), lambda r, h, kj, gi, j, c, vs: (r, h * g + gi, qt(r, kj, j, vs), 0)
    )
    kv_spec = pl.BlockSpec((_SQ, _SQ, tiles.k, d), lambda r, h, kj, gi, j, c, vs: (r, h, kj, 0))
    qtok = pl.BlockSpec((_SQ, tiles.q, 1), lambda r, h, kj, gi, j, c, vs: (r, qt(r, kj, j, vs), 0))
    ktok = pl.BlockSpec((_SQ, 1, tiles.k), lambda r, h, kj, gi, j, c, vs: (r, 0, kj))
    dk, dv = _call(
        functools.partial(_dkdv_kernel, scale=scale, n_k=n_k, n_q=n_q, groups=g),
        "jspec_attention_dkdv_tpu",
        (b, hkv, n_k, g, n_q),
        [q_spec, kv_spec, kv_spec, qtok, qtok, ktok, ktok, stat, q_spec, stat],
        [kv_spec, kv_spec],
        [(b, hkv, tk, d)] * 2,
        [(tiles.k, d), (tiles.k, d)],
        _plan(*_ids(x), tiles, by_key=True),
        inputs,
        interpret,
    )

    # dQ: grid (row, query head, query tile, key tile).
    kt = lambda r, i, j, vs: vs[(r * n_q + i) * n_k + j] >> 1
    q_spec = pl.BlockSpec((_SQ, _SQ, tiles.q, d), lambda r, h, i, j, c, vs: (r, h, i, 0))
    stat = pl.BlockSpec((_SQ, _SQ, tiles.q, 1), lambda r, h, i, j, c, vs: (r, h, i, 0))
    kv_spec = pl.BlockSpec(
        (_SQ, _SQ, tiles.k, d), lambda r, h, i, j, c, vs: (r, lax.div(h, g), kt(r, i, j, vs), 0)
    )
    qtok = pl.BlockSpec((_SQ, tiles.q, 1), lambda r, h, i, j, c, vs: (r, i, 0))
    ktok = pl.BlockSpec((_SQ, 1, tiles.k), lambda r, h, i, j, c, vs: (r, 0, kt(r, i, j, vs)))
    (dq,) = _call(
        functools.partial(_dq_kernel, scale=scale, n_q=n_q, n_k=n_k),
        "jspec_attention_dq_tpu",
        (b, hq, n_q, n_k),
        [q_spec, kv_spec, kv_spec, qtok, qtok, ktok, ktok, stat, q_spec, stat, q_spec],
        [q_spec],
        [(b, hq, tq, d)],
        [(tiles.q, d)],
        _plan(*_ids(x), tiles, by_key=False),
        (*inputs, _per_query(dq0, tq)),
        interpret,
    )
    heads_last = lambda x, t: jnp.swapaxes(x, 1, 2)[:, :t]
    return heads_last(dq, tq0), heads_last(dk, tk0), heads_last(dv, tk0)


# ---------------------------------------------------------------------------------------------
# The block interface of `blocks`.


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
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "b tq hq d"], Float[Array, "b tq hq"]]:
    """`blocks.fwd` on a TPU: the running output (float32, normalised) and log-sum-exp `acc`
    continued with k, v. block_q / block_k are accepted for `blocks`' signature and unused (the
    kernel tiles by `tiles`, default `TILES`)."""
    del block_q, block_k
    tiles = tiles or TILES
    _check(q, k, tiles, interpret)
    acc = acc or blocks.empty_acc(q)
    args = (q.astype(k.dtype), k, v.astype(k.dtype), q_seg, q_pos, k_seg, k_pos, *acc)
    return _fwd(*args, scale=float(scale), tiles=tiles, interpret=interpret)


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
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: Tiles | None = None,
    interpret: bool = False,
):
    """`blocks.bwd` on a TPU: float32 (dq, dk, dv) for this key set, given the global lse and
    delta; dq is added to the `dq` given."""
    del block_q, block_k
    tiles = tiles or TILES
    _check(q, k, tiles, interpret)
    dq = jnp.zeros(q.shape, jnp.float32) if dq is None else dq
    args = (q.astype(k.dtype), k, v.astype(k.dtype), q_seg, q_pos, k_seg, k_pos, lse, dout, delta)
    return _bwd(*args, dq, scale=float(scale), tiles=tiles, interpret=interpret)
