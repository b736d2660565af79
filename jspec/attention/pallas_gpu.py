"""The block kernel on NVIDIA GPUs: `blocks.fwd` / `blocks.bwd` as Pallas kernels (Triton lowering).

Same signatures and results as `blocks.fwd` and `blocks.bwd`, so `ring.py` can call either. The
visibility rule (`masks.visible`) is evaluated inside the kernel from segment ids and positions;
no score tile ever leaves the chip.

Skipping. Outside the kernel a small plan is built per row: for every query tile, the key tiles
that some query may see, split into the *fully visible* ones and the rest
(`blocks.tile_visibility`), each kind as runs of consecutive tiles. The kernel loops over the full
runs without a mask, then over the others with one. Tiles nobody sees are never touched, whatever
their order (packed documents, zigzag ring shards). The backward's key-tile kernel gets the
transposed plan.

Kernels (flash-attention 2):
- forward: one program per (query tile, row, query head), online softmax in base 2;
- dK/dV: one program per (key tile, row, KV head), looping over the G query heads of its group
  (GQA without atomics or a reduction afterwards);
- dQ: one program per (query tile, row, query head).
The tile sizes are the kernel's own (`Tiles`); the caller's `block_q` / `block_k` only keep the
signature of `blocks`. Lengths are padded here to whole tiles with segment 0 (sees nothing).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, masks, target

try:  # the Triton lowering's compiler parameters (num_warps, num_stages)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without the Triton backend
    plgpu = None

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SQ = pl.squeezed


class Tile(NamedTuple):
    """One kernel's tile: rows of queries, rows of keys, warps and pipeline depth."""

    q: int
    k: int
    warps: int
    stages: int


class Tiles(NamedTuple):
    """Tiles of the three kernels. Sizes are powers of two >= 16 (Triton's dot).

    The defaults won a sweep on one H200 (jax 0.11.2) at T=32K, 32/8 heads, D=128, bf16, causal:
    `jspec/bench/check_gpu_attention.py` reruns it.
    """

    fwd: Tile = Tile(128, 128, 8, 3)
    dkdv: Tile = Tile(64, 128, 8, 3)
    dq: Tile = Tile(128, 128, 8, 2)


TILES = Tiles()
# float32 tiles are twice the bytes: smaller tiles and shallower pipelines keep them within the
# H200's 227 KiB of shared memory per block (the bf16 defaults ask for 386 KiB in float32).
TILES_F32 = Tiles(fwd=Tile(64, 64, 4, 2), dkdv=Tile(32, 64, 4, 2), dq=Tile(64, 32, 4, 2))


def default_tiles(dtype) -> Tiles:
    """The tiles the library uses for inputs of this dtype."""
    return TILES if jnp.dtype(dtype).itemsize <= 2 else TILES_F32


def available() -> bool:
    """Whether the kernel compiles for the device programs are traced for (`target.device()`: a
    GPU, through Triton)."""
    return plgpu is not None and target.platform() == "gpu"


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head dim (a power of two >= 16); else use the XLA blocks."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


# ---------------------------------------------------------------------------------------------
# The plan: which tiles each program visits.


def _runs(x, n_runs):
    """Maximal runs of True along the last axis: their count, starts and stops (n_runs each)."""
    n = x.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    no = jnp.zeros_like(x[..., :1])
    first = x & ~jnp.concatenate([no, x[..., :-1]], axis=-1)
    last = x & ~jnp.concatenate([x[..., 1:], no], axis=-1)
    starts = jnp.sort(jnp.where(first, idx, n), axis=-1)[..., :n_runs]
    stops = jnp.sort(jnp.where(last, idx + 1, n), axis=-1)[..., :n_runs]
    return first.sum(-1, dtype=jnp.int32), starts, stops


def _plan(q_seg, q_pos, k_seg, k_pos, bq, bk, *, by_key):
    """[B, n_outer, 2 + 4 R] int32: what each program visits, as runs of consecutive tiles.

    Layout per outer tile: (number of fully visible runs, number of partly visible runs, the R
    (start, stop) pairs of the first kind, the R pairs of the second). Outer tiles are the query
    tiles (the key tiles when by_key); runs are of the other kind. Runs, not lists, so that the
    kernel's inner loop walks affine addresses that Triton can pipeline.
    """
    see, full = blocks.tile_visibility(q_seg, q_pos, k_seg, k_pos, bq, bk)
    if by_key:
        see, full = jnp.swapaxes(see, 1, 2), jnp.swapaxes(full, 1, 2)
    r = (see.shape[-1] + 1) // 2  # the most runs a row of n tiles can hold
    n_full, full_lo, full_hi = _runs(full, r)
    n_part, part_lo, part_hi = _runs(see & ~full, r)
    pairs = [
        jnp.stack([lo, hi], -1).reshape(*lo.shape[:-1], 2 * r)
        for lo, hi in ((full_lo, full_hi), (part_lo, part_hi))
    ]
    return jnp.concatenate([n_full[..., None], n_part[..., None], *pairs], axis=-1)


def _visit(plan_ref, body, carry):
    """Runs body(tile index, carry, masked) over the plan: full runs unmasked, then the rest."""
    r = (plan_ref.shape[0] - 2) // 4

    def runs(count, base, masked, carry):
        def run(i, c):
            lo, hi = plan_ref[base + 2 * i], plan_ref[base + 2 * i + 1]
            return lax.fori_loop(lo, hi, lambda j, c: body(j, c, masked), c)

        return lax.fori_loop(0, count, run, carry)

    carry = runs(plan_ref[0], 2, False, carry)
    return runs(plan_ref[1], 2 + 2 * r, True, carry)


def _dot(a, b, trans_b=False):
    """a @ b (or a @ b.T) accumulated in float32: a tensor-core dot under Triton.

    Float32 operands ask for HIGHEST: Triton's default for them is TF32 (about 1e-3 off).
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _params(tile: Tile):
    if plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=tile.warps, num_stages=tile.stages)


# ---------------------------------------------------------------------------------------------
# Kernels. Scores are kept in base 2: s2 = q.k * scale * log2(e), exp2 instead of exp.


def _fwd_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    qpos_ref,
    kseg_ref,
    kpos_ref,
    o0_ref,
    lse0_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    bk,
):
    q = q_ref[...]
    bq, d = q.shape
    qseg, qpos = qseg_ref[...][:, None], qpos_ref[...][:, None]

    def body(kj, carry, masked):
        m, l, acc = carry
        rows = pl.ds(pl.multiple_of(kj * bk, bk), bk)
        s = _dot(q, k_ref[rows, :], trans_b=True) * (scale * _LOG2E)
        if masked:
            s = jnp.where(
                masks.visible(qseg, qpos, kseg_ref[rows][None], kpos_ref[rows][None]), s, -jnp.inf
            )
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; exp2 against 0 then gives p = 0.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = jnp.exp2(s - m_use[:, None])
        corr = jnp.exp2(m - m_use)
        v = v_ref[rows, :]
        acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
        return m_new, l * corr + p.sum(axis=-1), acc

    # Continue the running (o, lse) (aliased to the outputs): m = lse, l = 1 (0 if empty), acc = o.
    lse0 = lse0_ref[...]
    init = (lse0 * _LOG2E, jnp.where(lse0 == -jnp.inf, 0.0, 1.0), o0_ref[...])
    m, l, acc = _visit(plan_ref, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf)


def _dkdv_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    qpos_ref,
    kseg_ref,
    kpos_ref,
    lse_ref,
    do_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    bq,
    groups,
):
    k, v = k_ref[...], v_ref[...]
    bk, d = k.shape
    kseg, kpos = kseg_ref[...][:, None], kpos_ref[...][:, None]

    def head(g, carry):
        def body(qi, carry, masked):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(qi * bq, bq), bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :].astype(q_ref.dtype)
            lse2 = lse_ref[g, rows][None] * _LOG2E
            # Transposed tile [bk, bq]: dK and dV come out without a transpose in registers.
            p = jnp.exp2(_dot(k, q, trans_b=True) * (scale * _LOG2E) - lse2)
            if masked:
                seen = masks.visible(qseg_ref[rows][None], qpos_ref[rows][None], kseg, kpos)
                p = jnp.where(seen, p, 0.0)
            dv = dv + _dot(p.astype(do.dtype), do)
            ds = p * (_dot(v, do, trans_b=True) - delta_ref[g, rows][None])
            dk = dk + _dot(ds.astype(q.dtype), q)
            return dk, dv

        return _visit(plan_ref, body, carry)

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _dq_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    qpos_ref,
    kseg_ref,
    kpos_ref,
    lse_ref,
    do_ref,
    delta_ref,
    dq0_ref,
    dq_ref,
    *,
    scale,
    bk,
):
    q = q_ref[...]
    do = do_ref[...].astype(q.dtype)
    bq, d = q.shape
    qseg, qpos = qseg_ref[...][:, None], qpos_ref[...][:, None]
    lse2 = lse_ref[...][:, None] * _LOG2E
    delta = delta_ref[...][:, None]

    def body(kj, dq, masked):
        rows = pl.ds(pl.multiple_of(kj * bk, bk), bk)
        k = k_ref[rows, :]
        p = jnp.exp2(_dot(q, k, trans_b=True) * (scale * _LOG2E) - lse2)
        if masked:
            p = jnp.where(
                masks.visible(qseg, qpos, kseg_ref[rows][None], kpos_ref[rows][None]), p, 0.0
            )
        ds = p * (_dot(do, v_ref[rows, :], trans_b=True) - delta)
        return dq + _dot(ds.astype(k.dtype), k)

    # Added to the running dq (aliased to the output).
    dq_ref[...] = dq0_ref[...] + _visit(plan_ref, body, jnp.zeros((bq, d), jnp.float32)) * scale


# ---------------------------------------------------------------------------------------------
# Wrappers: padding, layouts, the plan, the calls.


def _check(q, k, tiles: Tiles):
    d = q.shape[-1]
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}.")
    if not supports(d):
        raise ValueError(f"the Pallas kernel needs a power-of-two head dim >= 16; got {d}.")
    for t in tiles:
        if min(t.q, t.k) < 16 or t.q & (t.q - 1) or t.k & (t.k - 1):
            raise ValueError(f"tiles must be powers of two >= 16; got {t}.")


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _fwd(q, k, v, q_seg, q_pos, k_seg, k_pos, o0, lse0, *, scale, tiles, interpret):
    b, tq0, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    tile = tiles.fwd
    tq, tk = blocks.round_up(tq0, tile.q), blocks.round_up(k.shape[1], tile.k)
    q, q_seg, q_pos, o0 = (blocks.pad_rows(x, tq) for x in (q, q_seg, q_pos, o0))
    lse0 = jnp.swapaxes(blocks.pad_rows(lse0, tq), 1, 2)
    k, v, k_seg, k_pos = (blocks.pad_rows(x, tk) for x in (k, v, k_seg, k_pos))
    plan = _plan(q_seg, q_pos, k_seg, k_pos, tile.q, tile.k, by_key=False)
    nq = tq // tile.q

    def tile_i(i):  # heaviest (last) query tiles first, for causal balance
        return nq - 1 - i

    q_spec = pl.BlockSpec((_SQ, tile.q, _SQ, d), lambda i, r, h: (r, tile_i(i), h, 0))
    kv_spec = pl.BlockSpec((_SQ, tk, _SQ, d), lambda i, r, h: (r, 0, h // g, 0))
    qtok = pl.BlockSpec((_SQ, tile.q), lambda i, r, h: (r, tile_i(i)))
    ktok = pl.BlockSpec((_SQ, tk), lambda i, r, h: (r, 0))
    o_spec = pl.BlockSpec((_SQ, tile.q, _SQ, d), lambda i, r, h: (r, tile_i(i), h, 0))
    lse_spec = pl.BlockSpec((_SQ, _SQ, tile.q), lambda i, r, h: (r, h, tile_i(i)))
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, bk=tile.k),
        grid=(nq, b, hq),
        in_specs=[
            pl.BlockSpec((_SQ, _SQ, plan.shape[-1]), lambda i, r, h: (r, tile_i(i), 0)),
            q_spec,
            kv_spec,
            kv_spec,
            qtok,
            qtok,
            ktok,
            ktok,
            o_spec,
            lse_spec,
        ],
        out_specs=[o_spec, lse_spec],
        input_output_aliases={8: 0, 9: 1},
        out_shape=[
            jax.ShapeDtypeStruct((b, tq, hq, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hq, tq), jnp.float32),
        ],
        compiler_params=_params(tile),
        interpret=interpret,
        name="jspec_attention_fwd",
    )(plan, q, k, v, q_seg, q_pos, k_seg, k_pos, o0, lse0)
    return o[:, :tq0], jnp.swapaxes(lse, 1, 2)[:, :tq0]


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _bwd(q, k, v, q_seg, q_pos, k_seg, k_pos, lse, dout, delta, dq0, *, scale, tiles, interpret):
    """(dq0 plus this key set's dq, dk, dv): inputs padded to whole tiles, the statistics made
    heads-first, then the dK/dV kernel and the dQ kernel."""
    b, tq0, hq, d = q.shape
    tk0 = k.shape[1]
    tq = blocks.round_up(tq0, max(tiles.dkdv.q, tiles.dq.q))
    tk = blocks.round_up(tk0, max(tiles.dkdv.k, tiles.dq.k))
    q, dout, q_seg, q_pos, dq0 = (blocks.pad_rows(x, tq) for x in (q, dout, q_seg, q_pos, dq0))
    k, v, k_seg, k_pos = (blocks.pad_rows(x, tk) for x in (k, v, k_seg, k_pos))
    # Heads first for the per-row statistics: a query tile's values are contiguous.
    lse, delta = (
        jnp.swapaxes(blocks.pad_rows(x.astype(jnp.float32), tq), 1, 2) for x in (lse, delta)
    )
    inputs = (q, k, v, q_seg, q_pos, k_seg, k_pos, lse, dout, delta)
    call = functools.partial(_bwd_call, scale=scale, interpret=interpret)
    dk, dv = call("dkdv", tiles.dkdv, inputs)
    dq = call("dq", tiles.dq, (*inputs, dq0))
    return dq[:, :tq0], dk[:, :tk0], dv[:, :tk0]


def _bwd_call(kind, tile, inputs, *, scale, interpret):
    """One backward kernel over padded `inputs` (q, k, v, their segments and positions, lse,
    dout, delta; for "dq" then the running dq0): "dkdv", a program per (key tile, row, KV head)
    whose G query heads are a block of the head axis, returning (dk, dv); "dq", a program per
    (query tile, row, query head), heaviest (last) query tiles first as in the forward, returning
    dq0 plus this key set's dq (in place)."""
    q, k, v, q_seg, q_pos, k_seg, k_pos = inputs[:7]
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    g = hq // hkv
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    if kind == "dkdv":
        grid, by_key = (tk // tile.k, b, hkv), True
        outer = lambda j, r, h: (r, j, 0)  # noqa: E731
        q_spec = pl.BlockSpec((_SQ, tq, g, d), lambda j, r, h: (r, 0, h, 0))
        kv_spec = pl.BlockSpec((_SQ, tile.k, _SQ, d), lambda j, r, h: (r, j, h, 0))
        qtok = pl.BlockSpec((_SQ, tq), lambda j, r, h: (r, 0))
        ktok = pl.BlockSpec((_SQ, tile.k), lambda j, r, h: (r, j))
        stat = pl.BlockSpec((_SQ, g, tq), lambda j, r, h: (r, h, 0))
        kernel = functools.partial(_dkdv_kernel, scale=scale, bq=tile.q, groups=g)
        out_specs, out_shape = [kv_spec, kv_spec], [f32((b, tk, hkv, d))] * 2
        running, aliases = [], {}
    else:
        nq = tq // tile.q
        grid, by_key = (nq, b, hq), False
        outer = lambda i, r, h: (r, nq - 1 - i, 0)  # noqa: E731
        q_spec = pl.BlockSpec((_SQ, tile.q, _SQ, d), lambda i, r, h: (r, nq - 1 - i, h, 0))
        kv_spec = pl.BlockSpec((_SQ, tk, _SQ, d), lambda i, r, h: (r, 0, h // g, 0))
        qtok = pl.BlockSpec((_SQ, tile.q), lambda i, r, h: (r, nq - 1 - i))
        ktok = pl.BlockSpec((_SQ, tk), lambda i, r, h: (r, 0))
        stat = pl.BlockSpec((_SQ, _SQ, tile.q), lambda i, r, h: (r, h, nq - 1 - i))
        kernel = functools.partial(_dq_kernel, scale=scale, bk=tile.k)
        out_specs, out_shape = q_spec, f32(q.shape)
        running, aliases = [q_spec], {len(inputs): 0}  # dq0 (after the plan) is the output
    plan = _plan(q_seg, q_pos, k_seg, k_pos, tile.q, tile.k, by_key=by_key)
    in_specs = [pl.BlockSpec((_SQ, _SQ, plan.shape[-1]), outer), q_spec, kv_spec, kv_spec]
    in_specs += [qtok, qtok, ktok, ktok, stat, q_spec, stat, *running]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_params(tile),
        interpret=interpret,
        name=f"jspec_attention_{kind}",
    )(plan, *inputs)


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
    """`blocks.fwd` on the GPU: the running output (float32, normalised) and log-sum-exp `acc`
    continued with k, v, in place (the kernel's outputs alias `acc`).

    block_q / block_k are accepted for `blocks`' signature and unused (the kernel tiles by
    `tiles`, default `default_tiles(k.dtype)`). interpret=True runs the kernel in Pallas'
    interpreter (any backend).
    """
    del block_q, block_k
    tiles = tiles or default_tiles(k.dtype)
    _check(q, k, tiles)
    v = v.astype(k.dtype)
    q = q.astype(k.dtype)
    acc = acc or blocks.empty_acc(q)
    return _fwd(
        q,
        k,
        v,
        q_seg,
        q_pos,
        k_seg,
        k_pos,
        *acc,
        scale=float(scale),
        tiles=tiles,
        interpret=interpret,
    )


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
    """`blocks.bwd` on the GPU: float32 (dq, dk, dv) for this key set, given global lse, delta;
    dq is added to the `dq` given, in place."""
    del block_q, block_k
    tiles = tiles or default_tiles(k.dtype)
    _check(q, k, tiles)
    q = q.astype(k.dtype)
    v = v.astype(k.dtype)
    if dq is None:
        dq = jnp.zeros(q.shape, jnp.float32)
    return _bwd(
        q,
        k,
        v,
        q_seg,
        q_pos,
        k_seg,
        k_pos,
        lse,
        dout,
        delta,
        dq,
        scale=float(scale),
        tiles=tiles,
        interpret=interpret,
    )
