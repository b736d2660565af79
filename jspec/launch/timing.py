"""Timing a jitted function for the benchmarks: compiled ahead of time, one warm-up call, then the
mean over `iters` calls, each waited for."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax


class Timed(NamedTuple):
    ms: float  # per call
    compile_s: float
    compiled: Any  # the compiled program (memory_analysis, as_text)
    out: Any  # the warm-up call's output


def time_compiled(fn, inputs, iters: int) -> Timed:
    """`Timed` of `jit(fn)` on `inputs`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(compiled(*inputs))
    return Timed(1e3 * (time.perf_counter() - start) / iters, compile_s, compiled, out)
