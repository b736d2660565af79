"""Grouped matrix products of the mixture of experts: rows sorted by expert, each run of rows times
its expert's matrix, rows past the runs 0.

`jax.lax.ragged_dot` is right everywhere, but XLA:GPU lowers it as a dense product of every row
with every expert (E times the work; at the Qwen3-30B-A3B shape a buffer it cannot allocate). On
Hopper GPUs the products therefore run on the Mosaic GPU kernels that ship with JAX, under one
custom VJP:
    forward        y = x @ w[g]                       `ragged_dot_mgpu.ragged_dot`
    input grad     dx = dy @ w[g]^T                   the same kernel, `transpose_rhs=True`
    weight grad    dw[g] = x[run g]^T @ dy[run g]     `transposed_ragged_dot_mgpu`
Elsewhere (CPU, older GPUs) `lax.ragged_dot`. The kernels write only the rows of the runs and
multiply masks into their tiles, so rows past the runs are zeroed on the way in and out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Tiles of the Mosaic kernels: 128 x 128 output tiles over 64-wide K steps, 4 stages in flight.
TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


class Kernels(NamedTuple):
    """The two products the custom VJP is made of."""

    # (x [A,K], w [G,K,N] or, with transpose_rhs, [G,N,K], sizes [G]) -> [A,N]
    ragged: Callable[..., Array]
    # (x [A,M], dy [A,N], sizes [G]) -> [G,M,N]: per run, x^T dy
    transposed: Callable[..., Array]


def _lax_ragged(x, w, sizes, transpose_rhs=False):
    return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, sizes)


def _lax_transposed(x, dy, sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(x, dy, sizes, ragged_dot_dimension_numbers=numbers)


def _mosaic_ragged(x, w, sizes, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, **TILES)


def _mosaic_transposed(x, dy, sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=sizes, **TILES)


LAX = Kernels(_lax_ragged, _lax_transposed)  # what the Mosaic kernels must compute
MOSAIC = Kernels(_mosaic_ragged, _mosaic_transposed)  # Hopper GPUs


def _in_runs(x: Array, sizes: Array) -> Array:
    """x with the rows past the runs set to 0."""
    return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None], x, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, sizes, kernels: Kernels, varying: tuple[str, ...]):
    return _in_runs(kernels.ragged(_in_runs(x, sizes), w, sizes), sizes)


def _grouped_fwd(x, w, sizes, kernels, varying):
    x = _in_runs(x, sizes)
    return _in_runs(kernels.ragged(x, w, sizes), sizes), (x, w, sizes)


def _grouped_bwd(kernels, varying, residuals, dy):
    x, w, sizes = residuals
    dy = _in_runs(dy, sizes).astype(x.dtype)
    dx = _in_runs(kernels.ragged(dy, w, sizes, transpose_rhs=True), sizes)
    dw = kernels.transposed(x, dy, sizes).astype(w.dtype)
    return _varying(dx, varying), _varying(dw, varying), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _manual_axes(x: Array) -> tuple[str, ...]:
    """The manual mesh axes x varies over inside `shard_map` (none outside); jax 0.11 keeps them
    in the type's `vma`, jax 0.10 in its `manual_axis_type`."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return tuple(sorted(manual.varying if manual is not None else getattr(aval, "vma", ())))


def _varying(x: Array, axes: tuple[str, ...]) -> Array:
    """x varying over `axes`: inside `shard_map` a kernel's output varies over none, and a custom
    VJP's gradients must have the types of its inputs (read from the primal inputs, as static
    arguments: on jax 0.11.2 the GPU run failed when they were read from the residuals)."""
    missing = tuple(a for a in axes if a not in _manual_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def use_mosaic(x: Array, w: Array) -> bool:
    """Whether the Mosaic kernels serve these operands: a Hopper GPU, one dtype, sizes that fit
    their tiles."""
    device = jax.devices()[0]
    hopper = device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"
    k, n = w.shape[1:]
    fits = all(size % TILES["block_k"] == 0 and size % TILES["block_n"] == 0 for size in (k, n))
    return hopper and x.dtype == w.dtype and fits


def grouped_matmul(
    x_AK: Float[Array, "a k"],
    w_GKN: Float[Array, "g k n"],
    group_sizes: Int[Array, " g"],
    kernels: Kernels | None = None,
) -> Float[Array, "a n"]:
    """Row run g of x (runs in order from row 0; `group_sizes[g]` rows) times `w_GKN[g]`; rows
    past the runs give 0. `kernels` None: the Mosaic kernels where `use_mosaic`, else
    `lax.ragged_dot` (with its own autodiff); `LAX` runs the custom VJP on `lax` products."""
    if kernels is None and not use_mosaic(x_AK, w_GKN):
        return jax.lax.ragged_dot(x_AK, w_GKN, group_sizes)
    # Both operands vary over the union of their manual axes, as jax 0.11 makes them anyway (0.10
    # does not): the gradients then have one type on both, and the weights' is summed over the
    # axes they do not vary over by the transpose of this cast, outside the custom VJP.
    axes = tuple(sorted({*_manual_axes(x_AK), *_manual_axes(w_GKN)}))
    x_AK, w_GKN = _varying(x_AK, axes), _varying(w_GKN, axes)
    return _grouped(x_AK, w_GKN, group_sizes, kernels or MOSAIC, axes)
