"""Timing jitted functions for the benchmarks: compiled ahead of time, one warm-up call, then the
mean over `iters` calls, each waited for (`time_compiled`); the fastest of `iters` calls
(`best_time`); one body of a jitted loop, free of what a call pays once (`loop_seconds`); lines
of progress stamped with the seconds since the start (`log`); the device's copy rate, the memory
floors' bandwidth (`copy_bandwidth`)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Timed(NamedTuple):
    ms: float  # per call
    compile_s: float
    compiled: Any  # the compiled program (memory_analysis, as_text)
    out: Any  # the last call's output


def time_compiled(fn, inputs, iters: int) -> Timed:
    """`Timed` of `jit(fn)` on `inputs`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    for _ in range(iters):
        del out  # one output alive at a time: a step's gradients weigh as much as its weights
        out = jax.block_until_ready(compiled(*inputs))
    return Timed(1e3 * (time.perf_counter() - start) / iters, compile_s, compiled, out)


def best_time(fn, iters: int) -> float:
    """Seconds of the fastest of `iters` calls of `fn()`, after one call that compiles."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def loop_seconds(run, iters: int, short: int = 2, long: int = 10) -> float:
    """Seconds of one body of the jitted loop `run(count)` (count a traced int32, so both lengths
    share one program): the difference of a long and a short loop, so that what a call pays once
    (dispatch, slicing the weights for the loop) drops out."""
    seconds = lambda n: best_time(lambda: run(jnp.int32(n)), iters)
    return (seconds(long) - seconds(short)) / (long - short)


START = time.perf_counter()


def log(what: str) -> None:
    """A line of progress with the seconds since the start (compiles dominate a run's time)."""
    print(f"[{time.perf_counter() - START:6.0f} s] {what}", flush=True)


def copy_bandwidth(megabytes: int = 2048, iters: int = 20) -> float:
    """Bytes a second the default device reads and writes in an elementwise pass (a negation)
    over a `megabytes` array, its copy rate (4.1e12 on an H200, 3.0e12 on an H100), the fastest
    of `iters` passes."""
    x = jnp.ones((megabytes << 19,), jnp.bfloat16)
    negate = jax.jit(jnp.negative)
    return 2 * x.nbytes / best_time(lambda: negate(x), iters)
