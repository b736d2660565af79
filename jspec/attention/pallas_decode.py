"""The trunk of few-query attention as a Pallas kernel (Triton lowering): flash decoding.

`decode.decode_attention` folds a heads-major cache [B, Hkv, S, D] into an online-softmax state
(m, l, acc) for a few query rows per row. In XLA every chunk's scores [B, Hkv, G, R, chunk] go to
memory and back several times (mask, max, exp, sum, the cast before p @ v), and every slot is
read, filled or not. Here one program per (row, KV head, query tile, split of the slots) keeps its
scores on chip and visits only the row's filled blocks (up to its last slot of a non-zero segment);
the splits' states are merged by log-sum-exp outside. The tree's own keys (a few per row, given as
`branch`) are one more block, folded in by the first split: each query reads the cache and the
tree once, in one kernel, where folding them in XLA after it took a chain of small fusions a layer
(about 6% of an 8-node verify's time at batch 64 on an H200). The result is the state of
`decode.xla_state`, in the same units and layout.

Forward only: a `custom_vjp` takes gradients through the XLA path (`decode.xla_state`), so
`impl="decode"` stays differentiable on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, masks
from jspec.attention.pallas_gpu import _SQ, _dot, plgpu


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts its work (`jspec/bench/decode_kernel.py` times the choices)."""

    block_k: int = 64  # cache slots per step of a program's loop
    query_tile: int = 64  # query rows (G heads x R queries; masked past the end) per program
    target_programs: int = 264  # split the slots until about this many programs are in flight
    num_warps: int = 4
    num_stages: int = 2


TILING = Tiling()
_UNROLLED_SPLITS = 32  # `_merge_splits`: at most this many splits merge in one fusion
_LOG2E = math.log2(math.e)

State = tuple[Float[Array, "b r k g"], Float[Array, "b r k g"], Float[Array, "b r k g d"]]


def _kernel(live_ref, q_ref, qseg_ref, qpos_ref, *refs, scale, block_k, n_split, rows, nodes):
    # The cache's keys, values, ids and positions; the branch's keys, values and [tile, N] mask
    # (if given); the outputs. The query tile and the branch block reach past their arrays' ends
    # (`rows` query rows, `nodes` branch keys): loads there read 0 (segment 0: nothing seen) and
    # stores are dropped, where padding the arrays in XLA took a kernel a layer.
    k_ref, v_ref, kseg_ref, kpos_ref, *branch_refs, m_ref, l_ref, acc_ref = refs
    tile, d = q_ref.shape
    row_ok = pl.program_id(2) * tile + jnp.arange(tile) < rows
    load = lambda ref, ok: plgpu.load(ref, mask=ok, other=0)
    q = load(q_ref, row_ok[:, None]).astype(k_ref.dtype)  # one dtype for the tensor-core dots
    qseg, qpos = (load(ref, row_ok)[:, None] for ref in (qseg_ref, qpos_ref))
    fold = functools.partial(_fold, q, scale * _LOG2E)

    def body(j, state):
        slots = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        seen = masks.visible(qseg, qpos, kseg_ref[slots][None], kpos_ref[slots][None])
        return fold(state, k_ref[slots, :], v_ref[slots, :], seen)

    # The row's filled blocks, shared among the splits (a cache fills as the rollout goes on).
    live = live_ref[0]
    per_split = (live + n_split - 1) // n_split
    lo = pl.program_id(3) * per_split
    hi = jnp.minimum(lo + per_split, live)
    init = (
        jnp.full((tile,), -jnp.inf, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
        jnp.zeros((tile, d), jnp.float32),
    )
    state = lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
    if branch_refs:
        bk_ref, bv_ref, bseen_ref = branch_refs
        node_ok = jnp.arange(bk_ref.shape[0]) < nodes
        bk, bv = (load(ref, node_ok[:, None]) for ref in (bk_ref, bv_ref))
        seen = load(bseen_ref, row_ok[:, None] & node_ok[None]) != 0
        seen &= pl.program_id(3) == 0  # once per row: the first split
        state = fold(state, bk, bv, seen)
    m, l, acc = state
    plgpu.store(m_ref, m / _LOG2E, mask=row_ok)  # base 2 -> the natural units of `decode._continue`
    plgpu.store(l_ref, l, mask=row_ok)
    plgpu.store(acc_ref, acc, mask=row_ok[:, None])


def _fold(q, scale, state, k, v, seen):
    """Online softmax in base 2: keys k and values v [C, D] folded into the state (m, l, acc) of
    the queries q [T, D] where `seen` [T, C]."""
    m, l, acc = state
    s = jnp.where(seen, _dot(q, k, trans_b=True) * scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: p = 0 below
    p = jnp.exp2(s - m_use[:, None])
    corr = jnp.exp2(m - m_use)
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
    return m_new, l * corr + p.sum(axis=-1), acc


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tiling"))
def kernel_state(
    qg, q_seg, q_pos, k, v, seg, pos, branch=None, *, scale: float, interpret: bool, tiling: Tiling
) -> State:
    """The kernel's state (forward only) in the queries' layout [B,R,K,G(,D)]; `attention_state`
    is the differentiable entry. `branch`: the tree's keys and values [B,K,N,D] and which of them
    each query sees [B,R,N], or None."""
    b, r, hkv, g, d = qg.shape
    block_k = tiling.block_k
    s_len = k.shape[2]
    if s_len % block_k:  # `generate`'s caches are whole blocks already (`decode.cache_slots`)
        slots = blocks.round_up(s_len, block_k)
        k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, slots - s_len), (0, 0)]) for x in (k, v))
        seg, pos = (blocks.pad_rows(x, slots) for x in (seg, pos))
        s_len = slots
    n_blocks = s_len // block_k
    # Query row i = h * R + j is head h of the group, query j; a tile of them per program.
    rows = g * r
    tile = min(tiling.query_tile, max(16, pl.next_power_of_2(rows)))
    q_all = jnp.moveaxis(qg, 1, 3).reshape(b, hkv, rows, d)
    qseg_all, qpos_all = (jnp.tile(x, (1, g)) for x in (q_seg, q_pos))
    filled = jnp.max(jnp.where(seg != 0, jnp.arange(s_len) + 1, 0), axis=1)
    live = (-(-filled // block_k)).astype(jnp.int32)[:, None]  # the row's filled blocks

    n_tiles = -(-rows // tile)
    # Enough programs to fill the GPU, but no more splits than blocks.
    n_split = max(1, min(n_blocks, -(-tiling.target_programs // (b * hkv * n_tiles))))
    grid = (b, hkv, n_tiles, n_split)
    kv_spec = lambda n: pl.BlockSpec((_SQ, _SQ, n, d), lambda i, h, t, c: (i, h, 0, 0))
    tok_spec = pl.BlockSpec((_SQ, s_len), lambda i, h, t, c: (i, 0))
    qtok_spec = pl.BlockSpec((_SQ, tile), lambda i, h, t, c: (i, t))
    inputs = [live, q_all, qseg_all, qpos_all, k, v, seg, pos]
    in_specs = [
        pl.BlockSpec((_SQ, 1), lambda i, h, t, c: (i, 0)),
        pl.BlockSpec((_SQ, _SQ, tile, d), lambda i, h, t, c: (i, h, t, 0)),
        qtok_spec,
        qtok_spec,
        kv_spec(s_len),
        kv_spec(s_len),
        tok_spec,
        tok_spec,
    ]
    nodes = 0
    if branch is not None:
        bk, bv, seen = branch
        nodes = bk.shape[2]
        n_pad = max(16, pl.next_power_of_2(nodes))  # a tensor-core dot's least width
        seen = jnp.tile(seen, (1, g, 1)).astype(jnp.int32)  # row h * R + j sees what j sees
        inputs += [bk.astype(k.dtype), bv.astype(k.dtype), seen]
        seen_spec = pl.BlockSpec((_SQ, tile, n_pad), lambda i, h, t, c: (i, t, 0))
        in_specs += [kv_spec(n_pad), kv_spec(n_pad), seen_spec]

    def part(*tail):  # one program's share of a [B, Hkv, splits, rows, *tail] output
        return pl.BlockSpec(
            (_SQ, _SQ, _SQ, tile, *tail), lambda i, h, t, c: (i, h, c, t, *(0,) * len(tail))
        )

    m, l, acc = pl.pallas_call(
        functools.partial(
            _kernel, scale=scale, block_k=block_k, n_split=n_split, rows=rows, nodes=nodes
        ),
        grid=grid,
        in_specs=in_specs,
        out_specs=[part(), part(), part(d)],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, n_split, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n_split, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n_split, rows, d), jnp.float32),
        ],
        compiler_params=None
        if plgpu is None
        else plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="jspec_decode_trunk",
    )(*inputs)
    m, l, acc = _merge_splits(m, l, acc)
    queries_first = lambda x: jnp.moveaxis(x.reshape(b, hkv, g, r, *x.shape[3:]), 3, 1)
    return queries_first(m), queries_first(l), queries_first(acc)


def _merge_splits(m, l, acc):
    """One online-softmax state from the splits' (axis 2), by their log-sum-exp. Up to
    `_UNROLLED_SPLITS` splits it is written as elementwise steps over them, which XLA fuses into
    one kernel with what follows, where reductions over the axis take two kernels a layer; more
    splits (a long cache over a few KV heads, where the attention outweighs a launch) merge by
    reductions, so that the program does not grow with them."""
    n = m.shape[2]
    if n == 1:
        return m[:, :, 0], l[:, :, 0], acc[:, :, 0]
    if n > _UNROLLED_SPLITS:
        m_all = jnp.max(m, axis=2)
        m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
        w = jnp.exp(m - m_safe[:, :, None])  # 0 for a split that saw nothing (m = -inf)
        return m_all, jnp.sum(l * w, axis=2), jnp.sum(acc * w[..., None], axis=2)
    ms, ls, accs = ([x[:, :, i] for i in range(n)] for x in (m, l, acc))
    m_all = functools.reduce(jnp.maximum, ms)
    m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = [jnp.exp(mi - m_safe) for mi in ms]  # 0 for a split that saw nothing (m = -inf)
    l_all = functools.reduce(jnp.add, (li * wi for li, wi in zip(ls, w, strict=True)))
    acc_all = functools.reduce(
        jnp.add, (ai * wi[..., None] for ai, wi in zip(accs, w, strict=True))
    )
    return m_all, l_all, acc_all


def attention_state(
    qg: Float[Array, "b r k g d"],
    q_seg: Int[Array, "b r"],
    q_pos: Int[Array, "b r"],
    k: Float[Array, "b k s d"],
    v: Float[Array, "b k s d"],
    seg: Int[Array, "b s"],
    pos: Int[Array, "b s"],
    branch,
    xla_state,
    *,
    scale: float,
    interpret: bool = False,
    tiling: Tiling = TILING,
    kernel_state=kernel_state,
) -> State:
    """The state (m, l, acc) [B,R,K,G(,D)] of the queries qg after every cache slot and branch key
    they see, by the kernel (`kernel_state`: this GPU one, cut as `tiling` says, or
    `pallas_tpu_decode`'s); gradients by `xla_state` (same arguments, same result, plain XLA)."""

    kernel = functools.partial(kernel_state, scale=scale, interpret=interpret, tiling=tiling)

    @jax.custom_vjp
    def attend(*args):
        return kernel(*args)

    def bwd(args, ct):
        return jax.vjp(xla_state, *args)[1](ct)

    attend.defvjp(lambda *args: (kernel(*args), args), bwd)
    return attend(qg, q_seg, q_pos, k, v, seg, pos, branch)
