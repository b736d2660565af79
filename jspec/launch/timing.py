"""Timing a jitted function for the benchmarks: compiled ahead of time, one warm-up call, then the
mean over `iters` calls, each waited for."""

from __future__ import annotations

import time

import jax


def time_compiled(fn, inputs, iters: int):
    """(ms per call, the compiled program, its output) of `jit(fn)` on `inputs`."""
    compiled = jax.jit(fn).lower(*inputs).compile()
    out = jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(compiled(*inputs))
    return 1e3 * (time.perf_counter() - start) / iters, compiled, out
