"""The trunk of few-query attention as a Pallas TPU (Mosaic) kernel: `pallas_decode`'s flash
decoding, for TPUs.

One program per (row, KV head, block of cache slots), the blocks in order on one core: the state
(m, l, acc) of the row's query rows (the G query heads of the KV head times R queries) lives in
VMEM scratch across the blocks, and each block's scores never leave it. The row's filled blocks are
read (their count, `live`, is prefetched to scalar memory: a block past them repeats the last
one's index, so the pipeline fetches nothing new, and is skipped); the tree's keys (given as
`branch`) are one more fold after the last block. Every block spans whole trailing axes or
multiples of the (8, 128) tiles Mosaic wants, so nothing is padded but the cache's slots (to whole
blocks; `generate`'s caches are already). The result is `decode.xla_state`'s, in the same units and
layout.

Forward only: `pallas_decode.attention_state` wraps it in the same `custom_vjp` as the GPU kernel,
gradients through the XLA path. Checked in the Pallas interpreter on the CPU
(`DecodeOptions(backend="pallas_tpu_interpret")`), compiled for TPU slices by `jspec.jobs.plan
--topology`; no TPU has run it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jspec.attention import blocks, masks, pallas_tpu

BLOCK_K = 128  # cache slots a program folds in: one lane tile
_SQ = pl.squeezed


def _kernel(live_ref, q_ref, qseg_ref, qpos_ref, *refs, scale, has_branch):
    k_ref, v_ref, kseg_ref, kpos_ref, *rest = refs
    branch_refs, (m_out, l_out, acc_out, m_sc, l_sc, acc_sc) = rest[: 3 * has_branch], rest[-6:]
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    q = q_ref[...]
    fold = functools.partial(pallas_tpu.fold, q, scale, m_sc, l_sc, acc_sc)

    @pl.when(j < live_ref[b])
    def _():
        seen = masks.visible(qseg_ref[...], qpos_ref[...], kseg_ref[...], kpos_ref[...])
        fold(k_ref[...], v_ref[...], seen)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        if branch_refs:
            bk_ref, bv_ref, bseen_ref = branch_refs
            fold(bk_ref[...], bv_ref[...], bseen_ref[...] != 0)
        m_out[...], l_out[...], acc_out[...] = m_sc[...], l_sc[...], acc_sc[...]


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tiling"))
def kernel_state(
    qg, q_seg, q_pos, k, v, seg, pos, branch=None, *, scale: float, interpret: bool, tiling=None
):
    """The kernel's state (forward only) in the queries' layout [B,R,K,G(,D)], as
    `pallas_decode.kernel_state` (`tiling` unused: the block is `BLOCK_K` slots)."""
    b, r, hkv, g, d = qg.shape
    qg = qg.astype(k.dtype)
    s_len = k.shape[2]
    if s_len % BLOCK_K:
        slots = blocks.round_up(s_len, BLOCK_K)
        k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, slots - s_len), (0, 0)]) for x in (k, v))
        seg, pos = (blocks.pad_rows(x, slots) for x in (seg, pos))
        s_len = slots
    rows = g * r  # query row i = h * R + j: head h of the group, query j
    q_all = jnp.moveaxis(qg, 1, 3).reshape(b, hkv, rows, d)
    column = lambda x: jnp.tile(x, (1, g))[:, :, None]  # [B, rows, 1]
    filled = jnp.max(jnp.where(seg != 0, jnp.arange(s_len) + 1, 0), axis=1)
    live = (-(-filled // BLOCK_K)).astype(jnp.int32)
    last = lambda i, j, live: jnp.maximum(jnp.minimum(j, live[i] - 1), 0)  # no fetch past live
    kv_spec = pl.BlockSpec(
        (_SQ, _SQ, BLOCK_K, d), lambda i, h, j, live: (i, h, last(i, j, live), 0)
    )
    tok_spec = pl.BlockSpec((_SQ, 1, BLOCK_K), lambda i, h, j, live: (i, 0, last(i, j, live)))
    whole = lambda *shape: pl.BlockSpec(
        (_SQ, *shape), lambda i, h, j, live: (i,) + (0,) * len(shape)
    )
    per_head = lambda *shape: pl.BlockSpec(
        (_SQ, _SQ, *shape), lambda i, h, j, live: (i, h) + (0,) * len(shape)
    )
    inputs = [q_all, column(q_seg), column(q_pos), k, v, seg[:, None], pos[:, None]]
    in_specs = [per_head(rows, d), whole(rows, 1), whole(rows, 1), kv_spec, kv_spec]
    in_specs += [tok_spec, tok_spec]
    if branch is not None:
        bk, bv, seen = branch
        n = bk.shape[2]
        inputs += [
            bk.astype(k.dtype),
            bv.astype(k.dtype),
            jnp.tile(seen, (1, g, 1)).astype(jnp.int32),  # row h * R + j sees what j sees
        ]
        in_specs += [per_head(n, d), per_head(n, d), whole(rows, n)]
    f32 = lambda *shape: jax.ShapeDtypeStruct((b, hkv, *shape), jnp.float32)
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, scale=scale, has_branch=branch is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, s_len // BLOCK_K),
            in_specs=in_specs,
            out_specs=[per_head(rows, 1), per_head(rows, 1), per_head(rows, d)],
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, d), jnp.float32),
            ],
        ),
        out_shape=[f32(rows, 1), f32(rows, 1), f32(rows, d)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="jspec_decode_trunk_tpu",
    )(live, *inputs)
    queries_first = lambda x: jnp.moveaxis(x.reshape(b, hkv, g, r, *x.shape[3:]), 3, 1)
    return queries_first(m[..., 0]), queries_first(l[..., 0]), queries_first(acc)
