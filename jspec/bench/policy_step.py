"""The policy's training throughput at a shape: one forward and backward of the model over packed
rows (next-token cross-entropy, `jit(grad)`), timed, and its model FLOPs over the time against
the GPU's matmul ceiling (model FLOP utilization).

    python -m jspec.bench.policy_step --config qwen3-8b model.num_layers=8 --tokens 8192
    python -m jspec.bench.policy_step --config code-1b model.remat=none --tokens 8192 32768
    python -m jspec.bench.policy_step --device cpu --config tiny --tokens 256 --documents 2

Model FLOPs (`model_flops`) count what the model must compute, three times its forward: every
product (attention's projections, the MLP, or a mixture's routed experts and router, the LM head)
and attention over the pairs a query sees (causal within its document); not the norms, the
embedding lookup, remat's recomputation or padding. Rows: `--tokens` a row, `--documents` equal
documents each (a packed training row), `--rows` rows. Random weights in the config's dtypes.
`--attention pallas` (or `xla`) runs attention in the Triton kernel (XLA's blocks) where "auto"
would take the Mosaic GPU one, to compare them in the model. `--vocab-chunks 1 16` times the loss
with the output head over the whole vocabulary at once and over 16 slices of it
(`jspec.models.output_head`: less memory, one more product of the head's size). `--profile DIR`
traces one more step a row and prints its GPU kernels by kind and the heaviest. Prints a Markdown
table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import config as config_lib
from jspec.bench.attention import AUTO_KERNELS, restrict_auto, visible_pairs
from jspec.bench.kernel_profile import by_kind, gpu_kernels
from jspec.bench.timing import time_compiled
from jspec.config import ConfigError, ModelConfig
from jspec.jobs import cli
from jspec.models import create
from jspec.rl import grpo

MATMUL_CEILING = 801e12  # bf16 FLOP/s of dense products measured on one H200 (BENCHMARKS.md)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="code-1b")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--tokens", type=cli.at_least(1), nargs="+", default=[8192], help="tokens a row")
    p.add_argument(
        "--documents", type=cli.at_least(1), default=4, help="equal documents packed in a row"
    )
    p.add_argument("--rows", type=cli.at_least(1), default=1)
    p.add_argument(
        "--attention", choices=AUTO_KERNELS, default="auto", help="the block kernel on a GPU"
    )
    p.add_argument(
        "--vocab-chunks", type=cli.at_least(1), nargs="+", default=[1], help="head slices (rows)"
    )
    p.add_argument("--iters", type=cli.at_least(1), default=5)
    p.add_argument("--ceiling", type=cli.positive, default=MATMUL_CEILING, help="matmul FLOP/s")
    p.add_argument("--profile", metavar="DIR", help="also trace each step's GPU kernels")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_policy_step.json"))
    args = p.parse_intermixed_args(argv)
    for t in args.tokens:
        if t % args.documents:
            raise ConfigError(
                f"--tokens {t} is not a multiple of --documents {args.documents}: a row holds "
                f"equal documents; pick tokens divisible by it."
            )
    return args


def model_flops(cfg: ModelConfig, segment_ids: np.ndarray, positions: np.ndarray) -> float:
    """FLOPs of one forward and backward of the policy over these packed rows: three times the
    forward's products and attention (module docstring)."""
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    projections = 2 * h * (heads + 2 * cfg.num_kv_heads) * d + 2 * heads * d * h
    dense = 6 * h * cfg.intermediate_size
    routed = 6 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + 2 * h * cfg.num_experts
    mlps = sum(routed if sparse else dense for sparse in cfg.sparse_layers)
    per_token = cfg.num_layers * projections + mlps + 2 * h * cfg.vocab_size
    tokens = int((segment_ids > 0).sum())
    attention = cfg.num_layers * visible_pairs(segment_ids, positions, 0) * 4 * heads * d
    return 3.0 * (tokens * per_token + attention)


def packed_rows(cfg: ModelConfig, rows: int, tokens: int, documents: int):
    """Random tokens in `rows` rows of `documents` equal documents: tokens, segment ids,
    positions, [rows, tokens] each."""
    per_doc = tokens // documents
    segment_ids = np.repeat(np.arange(1, documents + 1, dtype=np.int32), per_doc)
    positions = np.tile(np.arange(per_doc, dtype=np.int32), documents)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, tokens), dtype=np.int32)
    return ids, *(np.broadcast_to(x, (rows, tokens)) for x in (segment_ids, positions))


def gradient_fn(graphdef, vocab_chunks: int = 1):
    """params, tokens, segment ids, positions -> the gradient of the mean next-token
    cross-entropy (a document's first token predicts nothing), the head over `vocab_chunks`
    slices of the vocabulary at a time."""

    def loss(params, tokens, segment_ids, positions):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, segment_ids, positions, head=False)
        logp = grpo.token_logprobs(hidden, model.head[...], tokens, 1.0, vocab_chunks)
        predicted = (positions > 0) & (segment_ids > 0)
        return -jnp.sum(jnp.where(predicted, logp, 0.0)) / jnp.maximum(predicted.sum(), 1)

    return jax.grad(loss)


def measure(cfg: ModelConfig, params, graphdef, tokens: int, chunks: int, args) -> dict:
    """One row of the table: the step's time, model FLOPs and utilization, and the compiled
    program's temporaries."""
    ids, seg, pos = packed_rows(cfg, args.rows, tokens, args.documents)
    inputs = (params, *map(jnp.asarray, (ids, seg, pos)))
    timed = time_compiled(gradient_fn(graphdef, chunks), inputs, args.iters)
    flops = model_flops(cfg, seg, pos)
    memory = timed.compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", 0) if memory is not None else 0
    profiled = {}
    if args.profile:
        log_dir = f"{args.profile}/{tokens}-{chunks}"
        profiled = dict(profile=profile(lambda: timed.compiled(*inputs), log_dir))
    return dict(
        tokens=tokens,
        rows=args.rows,
        vocab_chunks=chunks,
        ms=timed.ms,
        model_tflop=flops / 1e12,
        tflop_per_s=flops / (timed.ms / 1e3) / 1e12,
        of_ceiling=flops / (timed.ms / 1e3) / args.ceiling,
        temp_gb=temp / 1e9,
        compile_s=timed.compile_s,
        **profiled,
    )


def profile(run, log_dir: str) -> dict:
    """One step's GPU kernels: milliseconds by kind (matrix products, attention, the rest) and the
    twelve heaviest, printed to stderr."""
    ms, launches = gpu_kernels(run, log_dir)
    split = by_kind(ms)
    heaviest = [(k, v, launches[k]) for k, v in ms.most_common(12)]
    total = sum(ms.values())
    parts = ", ".join(f"{k} {v:.1f}" for k, v in split.items())
    print(f"{log_dir}: kernels {total:.1f} ms ({parts})", file=sys.stderr)
    for name, kernel_ms, n in heaviest:
        print(f"  {kernel_ms:8.2f} ms {n:5d}x  {name[:90]}", file=sys.stderr)
    return dict(kernel_ms=total, by_kind=split, launches=sum(launches.values()), heaviest=heaviest)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "gpu" and jax.devices()[0].platform != "gpu":
        platform = jax.devices()[0].platform
        raise SystemExit(f"--device gpu, but JAX sees {platform}; use --device cpu")
    restrict_auto(args.attention)
    cfg = config_lib.load(args.config, args.overrides).model
    for n in args.vocab_chunks:
        if cfg.vocab_size % n:
            raise ConfigError(
                f"--vocab-chunks {n} does not divide the vocabulary of {cfg.vocab_size} ids; "
                "pick divisors of it."
            )
    graphdef, params = nnx.split(create(cfg))
    count = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{args.config}: {count / 1e9:.2f}B parameters ({cfg.param_dtype}), {cfg.dtype} "
        f"compute, remat={cfg.remat}, {cfg.num_layers} layers"
    )
    rows = [
        measure(cfg, params, graphdef, t, n, args) for t in args.tokens for n in args.vocab_chunks
    ]
    print(
        "| tokens a row | rows | vocab chunks | forward + backward | model TFLOP | TFLOP/s | "
        "of ceiling | temporaries |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['rows']} | {r['vocab_chunks']} | {r['ms']:.1f} ms | "
            f"{r['model_tflop']:.2f} | "
            f"{r['tflop_per_s']:.1f} | {100 * r['of_ceiling']:.0f}% | {r['temp_gb']:.2f} GB |"
        )
    summary = dict(
        config=args.config, overrides=args.overrides, parameters=count, attention=args.attention
    )
    args.out.write_text(json.dumps({**summary, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(cli.run(main))
