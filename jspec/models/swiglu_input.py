"""A rollout step's residual add and the input half of its SwiGLU MLP in one kernel.

A decode or verify step feeds a few tokens a row through the MLP. With the input norm folded into
the gate and up weights (`layers.fold_input_norms`), XLA runs the residual add before it and that
half as three kernels a layer or more: the add with the sum of squares of its result, the product
(cuBLAS, or a split-K Triton product and its reduction), and silu(g / RMS) * (u / RMS). At batch 1
a small model's step is bound by such launches, not by its bytes. Here one Pallas kernel (Triton
lowering) does all of it: a program owns a block of the MLP's width for every token, streams the
gate and up rows of its block once, and in the same loop over the hidden axis adds the attention
output to the residual stream and sums its squares (1 / RMS scales a product's output, so it is
applied at the end); program i also writes chunk i of the new residual stream.

`layers.swiglu` after the residual add and `layers.normed_input` is the same in XLA: the path off
NVIDIA GPUs, and the kernel's reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from jspec.attention.pallas_gpu import _dot, plgpu


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts its work: the hidden axis up to `max_block_k` at a time (the largest
    power of two that divides it), and the MLP's width in blocks of 16 to `max_block_n`, the
    largest that still gives `target_programs` programs (a weight-streaming product needs most of
    the GPU's SMs)."""

    max_block_k: int = 128
    max_block_n: int = 64
    target_programs: int = 132
    num_warps: int = 4
    num_stages: int = 3

    def block_k(self, hidden: int) -> int:
        return min(self.max_block_k, hidden & -hidden)

    def block_n(self, width: int) -> int:
        n = self.max_block_n
        while n > 16 and (width % n or width // n < self.target_programs):
            n //= 2
        return n


TILING = Tiling()
MIN_ROWS = 16  # a tensor-core dot's least height: fewer tokens are padded (masked loads)


def supports(tokens: int, hidden: int, width: int, tiling: Tiling = TILING) -> bool:
    """Whether the kernel takes `tokens` rows of a `hidden`-wide residual stream into a
    `width`-wide MLP: at most 64 tokens (their accumulators stay in registers), both axes of
    whole blocks of 16 (a tensor-core dot's least), and a program for every chunk of the hidden
    axis (each writes one of the new residual stream)."""
    if tokens > 64 or hidden % 16 or width % 16:
        return False
    return width // tiling.block_n(width) >= hidden // tiling.block_k(hidden)


def _kernel(x_ref, o_ref, w_ref, x_out_ref, gated_ref, *, eps, rows, block_k):
    tile, hidden = x_ref.shape
    block_n = w_ref.shape[1]
    row_ok = (jnp.arange(tile) < rows)[:, None]
    program = pl.program_id(0)

    def body(i, carry):
        gate, up, squares = carry
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x, o = (plgpu.load(ref.at[:, cols], mask=row_ok, other=0) for ref in (x_ref, o_ref))
        x = (x.astype(jnp.float32) + o.astype(jnp.float32)).astype(x_ref.dtype)

        @pl.when(i == program)
        def _():
            plgpu.store(x_out_ref.at[:, cols], x, mask=row_ok)

        squares += jnp.sum(jnp.square(x.astype(jnp.float32)), axis=1)
        gate += _dot(x, w_ref[0, :, cols], trans_b=True)
        up += _dot(x, w_ref[1, :, cols], trans_b=True)
        return gate, up, squares

    zeros = jnp.zeros((tile, block_n), jnp.float32)
    init = (zeros, zeros, jnp.zeros((tile,), jnp.float32))
    gate, up, squares = lax.fori_loop(0, hidden // block_k, body, init)
    scale = lax.rsqrt(squares / hidden + eps)[:, None]  # the input norm folded into the weights
    gated = jax.nn.silu(gate * scale) * (up * scale)
    plgpu.store(gated_ref, gated.astype(gated_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tiling"))
def kernel(
    x_BTD: Float[Array, "b t d"],
    o_BTD: Float[Array, "b t d"],
    w_gate_up_CFD: Float[Array, "2 f d"],
    *,
    eps: float,
    interpret: bool = False,
    tiling: Tiling = TILING,
) -> tuple[Float[Array, "b t d"], Float[Array, "b t f"]]:
    """The residual stream h = x + o [B,T,D] and silu(g) * u [B,T,F] for g, u = h @
    w_gate_up[0].T, h @ w_gate_up[1].T over RMS(h) (the weights in the rollout's layout,
    `layers.fuse_products`, with the MLP's input norm folded in). `supports` says which shapes
    it takes; x, o and the weights share one dtype."""
    b, t, d = x_BTD.shape
    f = w_gate_up_CFD.shape[1]
    rows = b * t
    tile = max(MIN_ROWS, pl.next_power_of_2(rows))
    block_n = tiling.block_n(f)
    stream = pl.BlockSpec((tile, d), lambda j: (0, 0))
    x_out, gated = pl.pallas_call(
        functools.partial(_kernel, eps=eps, rows=rows, block_k=tiling.block_k(d)),
        grid=(f // block_n,),
        in_specs=[stream, stream, pl.BlockSpec((2, block_n, d), lambda j: (0, j, 0))],
        out_specs=[stream, pl.BlockSpec((tile, block_n), lambda j: (0, j))],
        out_shape=[
            jax.ShapeDtypeStruct((rows, d), x_BTD.dtype),
            jax.ShapeDtypeStruct((rows, f), x_BTD.dtype),
        ],
        compiler_params=None
        if plgpu is None
        else plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="jspec_swiglu_input",
    )(x_BTD.reshape(rows, d), o_BTD.reshape(rows, d), w_gate_up_CFD)
    return x_out.reshape(b, t, d), gated.reshape(b, t, f)
