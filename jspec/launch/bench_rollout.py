"""Rollout speed: plain decoding through `jspec.sampler.generate`, and the cost of verifying a draft
tree against one decode step, per batch size, and the cost of a whole speculative step.

    python -m jspec.launch.bench_rollout --config qwen3-8b --batches 1 16 64      # on a GPU
    python -m jspec.launch.bench_rollout --device cpu --config tiny --batches 2   # a smoke test

For each batch: prompts of `--prompt-len` tokens are prefilled; `generate` runs `--new-tokens`
greedy tokens with no draft (its verify step holds only the root, so a step is one decode); the
decode step time is (time of M tokens - time of 1 token) / (M - 1), which removes the prefill. The
cost curve runs the target's branch forward over a chain of N nodes against the same cache in a
jitted loop, reported in decode steps (N = 1 is the decode step of the verify path). The memory
floor of a decode step is (weights + KV cache read) / the copy bandwidth (`--bandwidth`, 4.1 TB/s
on an H200). A speculative step (an EAGLE-3 draft proposing `TREES`, verify, cache updates) is
timed the same way and reported in decode steps: the accepted length at which it breaks even.
Weights are random: speed only, not acceptance. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import config as config_lib
from jspec.config import RolloutConfig, TreeConfig
from jspec.models import create, transformer
from jspec.models.draft import Eagle3Config, create_eagle3
from jspec.sampler import decoding, generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="qwen3-8b")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tree-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--no-spec", action="store_true", help="skip the speculative steps")
    p.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3 draft vocabulary")
    p.add_argument(
        "--compare-blocks",
        action="store_true",
        help="also time the plain step with the block kernels in place of impl='decode'",
    )
    p.add_argument("--iters", type=int, default=3, help="timed repeats (the best is kept)")
    p.add_argument("--bandwidth", type=float, default=4.1e12, help="copy bytes/s of the device")
    p.add_argument("--out", default="bench_rollout.json")
    return p.parse_args(argv)


# Trees of the speculative steps timed: a step's cost in decode steps is the accepted length at
# which speculation breaks even.
TREES = {
    "chain 4": TreeConfig(kind="chain", depth=4, sampled=False),
    "dynamic 8 (SGLang)": TreeConfig(kind="dynamic", depth=5, top_k=4, total_tokens=8),
}


@contextlib.contextmanager
def few_queries(n: int):
    """Rollout attention takes `impl="decode"` up to n queries per row (0: the block kernels);
    `generate`'s compiled programs are dropped on the way in and out, as they baked in the rule."""
    saved, transformer.FEW_QUERIES = transformer.FEW_QUERIES, n
    decoding._generate.clear_cache()
    try:
        yield
    finally:
        transformer.FEW_QUERIES = saved
        decoding._generate.clear_cache()


def best_time(fn, iters: int) -> float:
    """Seconds of the fastest of `iters` calls, after one call that compiles."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def step_seconds(model, draft, tree, prompts, lengths, new_tokens, iters) -> float:
    """Time of one step of the `generate` loop (draft + verify + bookkeeping), prefill excluded:
    a plain decode step when `draft` is None."""
    key = jax.random.key(0)
    config = lambda m: RolloutConfig(max_new_tokens=m, temperature=0.0, tree=tree)
    run = lambda m: lambda: generate(model, draft, prompts, lengths, key, config(m))
    steps = int(np.max(run(new_tokens)().stats.steps))
    return (best_time(run(new_tokens), iters) - best_time(run(1), iters)) / steps


def verify_seconds(model, prompts, lengths, n: int, iters: int, loops: int = 8) -> float:
    """Time of one branch forward over a chain of n nodes against a prefilled cache."""
    graphdef, state = nnx.split(model)
    b, t = prompts.shape
    m = lambda state: nnx.merge(graphdef, state)
    cache = jax.jit(lambda s: m(s).prefill(prompts, m(s).init_cache(b, t + n), lengths)[1])(state)
    depth = jnp.arange(1, n + 1, dtype=jnp.int32)
    anchor = jnp.broadcast_to((cache.length - 1)[:, None], (b, n))
    parent = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (b, n))
    positions = cache.length[:, None] + depth - 1

    @jax.jit
    def run(state, cache):
        def body(i, acc):
            tokens = (prompts[:, :n] + i) % model.config.vocab_size
            logits = m(state).branch_forward(cache, tokens, positions, anchor, parent)[0]
            return acc + logits[:, -1, 0]

        return jax.lax.fori_loop(0, loops, body, jnp.zeros((b,), jnp.float32))

    return best_time(lambda: run(state, cache), iters) / loops


def measure(model, draft, batch: int, weight_bytes: int, args) -> dict:
    """One row of the table: the plain step, the verify cost curve, the speculative steps."""
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)
    time_step = lambda d, tree: step_seconds(
        model, d, tree, prompts, lengths, args.new_tokens, args.iters
    )
    step = time_step(None, TreeConfig())
    blocks_step = None
    if args.compare_blocks:
        with few_queries(0):
            blocks_step = time_step(None, TreeConfig())
    kv_bytes = (
        2 * cfg.num_layers * batch * (args.prompt_len + args.new_tokens // 2) * cfg.num_kv_heads
        * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    )  # fmt: skip
    floor = (weight_bytes + kv_bytes) / args.bandwidth
    curve = {n: verify_seconds(model, prompts, lengths, n, args.iters) for n in args.tree_sizes}
    return dict(
        batch=batch,
        decode_ms=1e3 * step,
        decode_ms_block_kernels=None if blocks_step is None else 1e3 * blocks_step,
        tokens_per_s=batch / step,
        floor_ms=1e3 * floor,
        of_floor=floor / step,
        verify_ms={n: 1e3 * s for n, s in curve.items()},
        verify_in_decode_steps={n: s / curve[min(curve)] for n, s in curve.items()},
        spec_step_in_decode_steps={
            k: time_step(draft, t) / step for k, t in ({} if args.no_spec else TREES).items()
        },
    )


def main(argv=None):
    args = parse_args(argv)
    if args.device == "gpu" and jax.devices()[0].platform != "gpu":
        platform = jax.devices()[0].platform
        raise SystemExit(f"--device gpu, but JAX sees {platform}; use --device cpu")
    cfg = config_lib.load(args.config, args.overrides).model
    model = create(cfg)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    draft = create_eagle3(Eagle3Config.for_target(cfg, args.draft_vocab))
    rows = []
    for b in args.batches:
        rows.append(measure(model, draft, b, weight_bytes, args))
        print_row(rows[-1])
        pathlib.Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))


def print_row(r) -> None:
    curve = ", ".join(f"{n}: {x:.2f}" for n, x in r["verify_in_decode_steps"].items())
    blocks = r["decode_ms_block_kernels"]
    blocks = "" if blocks is None else f" (block kernels {blocks:.2f})"
    parts = [
        f"batch {r['batch']:4d}",
        f"decode {r['decode_ms']:8.2f} ms" + blocks,
        f"{r['tokens_per_s']:10,.0f} tok/s",
        f"floor {r['floor_ms']:.2f} ms ({100 * r['of_floor']:.0f}%)",
        f"verify/decode {curve}",
        "spec step/decode "
        + ", ".join(f"{k}: {x:.2f}" for k, x in r["spec_step_in_decode_steps"].items()),
    ]
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
