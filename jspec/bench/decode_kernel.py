"""The Pallas decode kernel (`jspec.attention.pallas_decode`) under each tiling, beside the XLA
path it replaces: time, the cache bandwidth it reaches, and its error against XLA.

    python -m jspec.bench.decode_kernel               # on a GPU: the Qwen3-8B shape
    python -m jspec.bench.decode_kernel --device cpu --batches 2 --queries 1 --slots 128 \
        --block-k 16 --num-warps 4 --num-stages 2 --target-programs 16   # smoke test, interpreted

For each batch size and query count per row (1: a decode step; more: a verify tree), every tiling
of the cross product of the `--block-k`, `--num-warps`, `--num-stages` and `--target-programs`
lists folds a cache with `--slots` filled slots per row into the online-softmax state, as a
rollout layer does (the kernel, then the merge of its splits). Time is one body of a jitted loop
of such calls (the difference of loops of 220 and 20 calls); GB/s counts the K and V bytes of the
filled slots. Each tiling's state must match the XLA path's within bf16 error, else the run
stops. Prints, per shape, XLA, the library's tiling and the fastest one, and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jspec.attention import blocks, decode, pallas_decode
from jspec.bench.timing import loop_seconds
from jspec.jobs import cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--batches", type=cli.at_least(1), nargs="+", default=[1, 16, 64, 256])
    p.add_argument(
        "--queries", type=cli.at_least(1), nargs="+", default=[1, 9], help="query rows per row"
    )
    p.add_argument(
        "--slots", type=cli.at_least(1), default=576, help="cache slots per row, all filled"
    )
    p.add_argument("--heads", type=cli.at_least(1), default=32)
    p.add_argument("--kv-heads", type=cli.at_least(1), default=8)
    p.add_argument("--head-dim", type=cli.at_least(1), default=128)
    p.add_argument("--block-k", type=cli.at_least(1), nargs="+", default=[64, 128])
    p.add_argument("--num-warps", type=cli.at_least(1), nargs="+", default=[4, 8])
    p.add_argument("--num-stages", type=cli.at_least(1), nargs="+", default=[2, 3])
    p.add_argument("--target-programs", type=cli.at_least(1), nargs="+", default=[264, 1056])
    p.add_argument("--iters", type=cli.at_least(1), default=3)
    p.add_argument("--out", default="bench_decode_kernel.json")
    return p.parse_args(argv)


def inputs(batch: int, queries: int, args):
    """Queries [B,R,K,G,D] right after a cache whose first `--slots` slots per row are filled,
    heads-major, its slots rounded up to whole blocks of every tiling, as `generate` rounds them
    (`decode.cache_slots`): no tiling pads (copies) the cache."""
    rng = np.random.default_rng(0)
    g, filled = args.heads // args.kv_heads, args.slots
    s = blocks.round_up(filled, max(pallas_decode.TILING.block_k, *args.block_k))
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    qg = normal(batch, queries, args.kv_heads, g, args.head_dim)
    k, v = (normal(batch, args.kv_heads, s, args.head_dim) for _ in range(2))
    row = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, len(x)))
    seg = row(np.arange(s) < filled)
    return qg, row(np.ones(queries)), row(filled + np.arange(queries)), k, v, seg, row(np.arange(s))


def trunk_loop(trunk, args_):
    """`run(count)`: `count` calls of `trunk(*args_)` in a jitted loop, each call's queries moved
    by the last one's state (all of it, so no part of a call is dead code) so that nothing is
    hoisted out of the loop. A call's time includes one read of its state, as a layer's does."""

    @jax.jit
    def run(count, qg, *rest):
        def body(_, carry):
            m, l, acc = trunk(qg + 0 * carry.astype(qg.dtype), *rest)
            return carry + 0 * (jnp.max(m) + jnp.sum(l) + jnp.sum(acc))

        return jax.lax.fori_loop(0, count, body, jnp.float32(0))

    return lambda count: run(count, *args_)


def error(state, expected) -> float:
    """Largest difference of the normalised outputs (acc / l) relative to their largest value, or
    of the log-sum-exp (m + log l) by which the state is merged with the new tokens', whichever
    is larger."""
    out = lambda m, l, acc: acc / l[..., None]
    lse = lambda m, l, acc: m + jnp.log(l)
    got, want = out(*state), out(*expected)
    return max(
        float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))),
        float(jnp.max(jnp.abs(lse(*state) - lse(*expected)))),
    )


def tilings(args) -> list[pallas_decode.Tiling]:
    """The library's tiling first, then the rest of the cross product of the lists asked for."""
    grid = itertools.product(args.block_k, args.num_warps, args.num_stages, args.target_programs)
    asked = [
        pallas_decode.Tiling(block_k=k, num_warps=w, num_stages=s, target_programs=p)
        for k, w, s, p in grid
    ]
    return [pallas_decode.TILING, *(t for t in asked if t != pallas_decode.TILING)]


def measure(batch: int, queries: int, args) -> list[dict]:
    """One row for XLA, then one per tiling (`tilings`), at this shape."""
    args_ = inputs(batch, queries, args)
    scale = args.head_dim**-0.5
    xla = functools.partial(decode.xla_state, scale=scale)
    expected = jax.jit(xla)(*args_)
    cache_bytes = 2 * batch * args.kv_heads * args.slots * args.head_dim * 2
    row = lambda name, seconds, err: dict(
        batch=batch,
        queries=queries,
        tiling=name,
        us=1e6 * seconds,
        gb_per_s=cache_bytes / seconds / 1e9,
        error=err,
    )
    seconds = lambda f: loop_seconds(trunk_loop(f, args_), args.iters, short=20, long=220)
    rows = [row("xla", seconds(xla), 0.0)]
    for tiling in tilings(args):
        kernel = functools.partial(
            pallas_decode.kernel_state, scale=scale, tiling=tiling, interpret=args.device == "cpu"
        )
        err = error(jax.jit(kernel)(*args_), expected)
        if err > 2e-2:
            raise SystemExit(f"{tiling} at batch {batch}, {queries} queries: error {err:.3g}")
        name = (
            f"k{tiling.block_k} w{tiling.num_warps} s{tiling.num_stages} p{tiling.target_programs}"
        )
        rows.append(row(name, seconds(kernel), err))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.device == "gpu" and jax.devices()[0].platform != "gpu":
        raise SystemExit(
            f"--device gpu, but JAX sees {jax.devices()[0].platform}; use --device cpu"
        )
    rows = []
    for batch, queries in itertools.product(args.batches, args.queries):
        shape = measure(batch, queries, args)
        rows += shape
        xla, default, *_ = shape
        best = min(shape[1:], key=lambda r: r["us"])
        part = lambda label, r: f"{label} {r['us']:8.1f} us ({r['gb_per_s']:5.0f} GB/s)"
        print(
            f"batch {batch:4d}, {queries:2d} queries: {part('XLA', xla)} | "
            f"{part('default', default)} {default['tiling']} | "
            f"{part('best', best)} {best['tiling']}",
            flush=True,
        )
        pathlib.Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))


if __name__ == "__main__":
    sys.exit(cli.run(main))
