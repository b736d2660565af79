"""What a rollout step does between a layer's fused q/k/v product and its attention, in one kernel.

After the product (`layers.fused_product`'s layout [B,T,K,G+2,E]) a decode step scales it by the
folded input norm, norms q and k (Qwen3), rotates them, and writes k and v into the cache. In XLA
that is five kernels a layer (the input norm's RMS, the q/k norm, q's rotary, a scatter for k with
its rotary, one for v), each a launch of a microsecond or two around very little work: at batch 1 a
step of a small model is bound by its launches, not by its bytes. Here one Pallas kernel (Triton
lowering) does it all: it takes the RMS of the product's input itself (the folded input norm's
scale; in XLA a reduction and an rsqrt kernel, which do not fuse with the residual add before
them), sends the query heads out rotated in the layout the decode kernel reads (`pallas_decode`: a
KV head's G heads, then the tokens), and writes k and v into the cache's slots in place
(`input_output_aliases`), slots past its end dropped. A program finishes one head (of q, k or v)
of a token, or beyond a few tokens a step a KV head's G+2 in turn (`ROW_PROGRAMS_UP_TO`).

`cache.finish_and_write` is the same in XLA (the model's own functions): the path off NVIDIA
GPUs, and what the kernel is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jspec.attention.pallas_gpu import _SQ, plgpu

Cache = Float[Array, "b k s e"]

# Every program sums the squares of its token's input (8 KB for Qwen3-8B): a program a head reads
# it (G+2) x K times a token, which at 512 tokens (an 8-node verify at batch 64) took 35 us a
# layer on an H100, where the work is worth 2-3. Beyond this many tokens a step, a program takes a
# KV head's heads one after another, reading the input K times a token.
ROW_PROGRAMS_UP_TO = 16


def supports(rms_input) -> bool:
    """Whether the kernel takes a product's input of this width (None: no input norm folded): its
    sum of squares runs over power-of-two chunks of at least 128 that divide it."""
    return rms_input is None or rms_input.shape[-1] % 128 == 0


def _kernel(qkv_ref, x_ref, norm_ref, cos_ref, sin_ref, slot_ref, k_in, v_in, *refs, eps):
    del k_in, v_in  # the same buffers as the outputs k_ref, v_ref
    q_ref, k_ref, v_ref = refs
    e = qkv_ref.shape[-1]
    half = pl.ds(0, e // 2), pl.ds(e // 2, e // 2)
    f32 = lambda x: x.astype(jnp.float32)
    scale = 1.0
    if x_ref is not None:  # 1 / RMS(x): the input norm folded into the product
        d = x_ref.shape[0]
        chunk = min(d & -d, 1024)  # a power of two that divides d (at least 128: `supports`)
        squares = sum(jnp.sum(f32(x_ref[pl.ds(i, chunk)]) ** 2) for i in range(0, d, chunk))
        scale = jax.lax.rsqrt(squares / d + eps)
    if qkv_ref.ndim == 1:  # one row a program: row program_id(3) of G query heads, then k and v
        group = pl.num_programs(3) - 2
        rows = [(pl.program_id(3), ())]
    else:  # a KV head's every row (its number static), at its index in the blocks
        group = qkv_ref.shape[0] - 2
        rows = [(n, (jnp.int32(n),)) for n in range(group + 2)]  # (interpreted stores take no int)
    # Every load first, so that their latencies overlap (no load waits on a branch).
    loaded = [
        (
            [f32(qkv_ref[(*at, h)]) * scale for h in half],
            [1.0, 1.0] if norm_ref is None else [f32(norm_ref[(*at, h)]) for h in half],
        )
        for _, at in rows
    ]
    cos, sin = ([ref[h] for h in half] for ref in (cos_ref, sin_ref))
    slot = slot_ref[...]
    in_cache = slot < k_ref.shape[0]

    def store(pair, ref, at=(), when=True):
        for x, h in zip(pair, half, strict=True):
            plgpu.store(ref.at[(*at, h)], x.astype(ref.dtype), mask=jnp.full(x.shape, when))

    def finish(head, at, lo, hi, w):  # (`pl.when` of a Python bool is an `if`)
        @pl.when(head == group + 1)
        def _():
            store((lo, hi), v_ref, (slot,), in_cache)

        @pl.when(head <= group)
        def _():
            r = 1.0
            if norm_ref is not None:
                r = jax.lax.rsqrt((jnp.sum(lo * lo) + jnp.sum(hi * hi)) / e + eps)
            x_lo, x_hi = lo * r * w[0], hi * r * w[1]
            rotated = (x_lo * cos[0] + x_hi * sin[0], x_hi * cos[1] + x_lo * sin[1])

            @pl.when(head < group)
            def _():
                store(rotated, q_ref, at)

            @pl.when(head == group)
            def _():
                store(rotated, k_ref, (slot,), in_cache)

    for (head, at), ((lo, hi), w) in zip(rows, loaded, strict=True):
        finish(head, at, lo, hi, w)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "head_programs"))
def kernel(
    qkv: Float[Array, "b t k n e"],
    rms_input: Float[Array, "b t d"] | None,
    norm: Float[Array, "n e"] | None,
    cos_sin: tuple[Float[Array, "b t 1 e"], Float[Array, "b t 1 e"]],
    slot: Int[Array, "b t"],
    k_cache: Cache,
    v_cache: Cache,
    *,
    eps: float,
    interpret: bool = False,
    head_programs: bool | None = None,
):
    """`cache.finish_and_write`'s results by one Pallas kernel: q [B,T,H,E] (a transpose of the
    kernel's [B,K,G,T,E], which the decode kernel's layout undoes), the caches written in place.
    `rms_input`: the product's input, whose 1 / RMS scales it (None: no scale; `supports` says
    which widths). The slots of a row are distinct (`KVCache.slots`, past the end too): no two
    programs write one cache row. `head_programs`: a program a KV head (its G+2 rows) rather than
    a row (None: beyond `ROW_PROGRAMS_UP_TO` tokens)."""
    b, t, k, n, e = qkv.shape
    g, s = n - 2, k_cache.shape[2]
    if head_programs is None:
        head_programs = b * t > ROW_PROGRAMS_UP_TO
    rows, q_rows = (n, g) if head_programs else (_SQ, _SQ)
    cos, sin = (x[:, :, 0].astype(jnp.float32) for x in cos_sin)
    token = lambda *tail: pl.BlockSpec(
        (_SQ, _SQ, *tail), lambda i, j, h, r: (i, j, *(0,) * len(tail))
    )
    cache = pl.BlockSpec((_SQ, _SQ, s, e), lambda i, j, h, r: (i, h, 0, 0))
    in_specs = [
        pl.BlockSpec((_SQ, _SQ, _SQ, rows, e), lambda i, j, h, r: (i, j, h, r, 0)),
        None if rms_input is None else token(rms_input.shape[-1]),
        None if norm is None else pl.BlockSpec((rows, e), lambda i, j, h, r: (r, 0)),
        token(e),
        token(e),
        token(),
        cache,
        cache,
    ]
    q_spec = pl.BlockSpec(  # (the programs of k and v store no q)
        (_SQ, _SQ, q_rows, _SQ, e), lambda i, j, h, r: (i, h, jnp.minimum(r, g - 1), j, 0)
    )
    inputs = [qkv, rms_input, norm, cos, sin, slot.astype(jnp.int32), k_cache, v_cache]
    cache_at = len(jax.tree.leaves(inputs)) - 2  # (an input that is None has no leaf)
    q_BKGTE, k_cache, v_cache = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(b, t, k, 1 if head_programs else n),
        in_specs=in_specs,
        out_specs=[q_spec, cache, cache],
        out_shape=[
            jax.ShapeDtypeStruct((b, k, g, t, e), k_cache.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={cache_at: 1, cache_at + 1: 2},
        compiler_params=None if plgpu is None else plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jspec_qkv_epilogue",
    )(*inputs)
    q_BTHE = jnp.moveaxis(q_BKGTE, 3, 1).reshape(b, t, k * g, e)
    return q_BTHE, k_cache, v_cache
