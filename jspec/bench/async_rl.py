"""Asynchronous against synchronous RL on two devices: step time, tokens/s, weight transfer time.

    python -m jspec.bench.async_rl                         # 1.2B policy, two GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m jspec.bench.async_rl --small             # to try it on a CPU

Runs jspec.jobs.train_rl once per draft (co-trained, none) and mode:
    sync        rl.max_lag=0, rollouts and training both on the two devices (data parallel)
    sync-split  rl.max_lag=0, one rollout device and one training device: the split, no overlap
    async       rl.max_lag=1, the same split: the rollouts of step n + 1 run while step n trains
and reports medians over the steps after the first --skip (compilation): step time, tokens/s
(response tokens of a step over its wall time), rollout time (from dispatch to the tokens on the
host: in async mode the wait behind the previous rollout included), train and weight-transfer
time, mean accepted length. Compiled programs go to train_rl's persistent cache
(runs/.jax_cache), which sync-split and async share; a second invocation compiles nothing. The
policy is a 1.2B Qwen3-style one of random weights and a byte vocabulary (two warm-start steps),
so acceptance says nothing about a trained policy. Prints a Markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import jax
import numpy as np

from jspec import config as config_lib
from jspec.jobs import cli, train_rl

MODES = {
    "sync": ["rl.max_lag=0"],
    "sync-split": ["rl.max_lag=0", "rl.rollout_mesh.data=1"],
    "async": ["rl.max_lag=1", "rl.rollout_mesh.data=1"],
}
LARGE = [
    "model.hidden_size=2048",
    "model.num_layers=24",
    "model.num_heads=16",
    "model.num_kv_heads=8",
    "model.head_dim=128",
    "model.intermediate_size=6144",
    "model.dtype=bfloat16",
    "model.param_dtype=bfloat16",
]
SMALL = [
    "model.hidden_size=32",
    "model.num_layers=3",
    "model.head_dim=8",
    "model.intermediate_size=64",
    "rl.ttt_steps=1",
    "rl.sft_batch=16",
]
COLUMNS = (
    "step_time",
    "tokens_per_s",
    "rollout_time",
    "train_time",
    "transfer_time",
    "accepted_length",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="extra dotted overrides, e.g. rl.prompts=16")
    p.add_argument("--small", action="store_true", help="the test-size model instead of 1.2B")
    p.add_argument("--steps", type=cli.at_least(1), default=8, help="RL steps per run")
    p.add_argument(
        "--skip", type=cli.at_least(0), default=2, help="first steps left out (compilation)"
    )
    p.add_argument("--drafts", default="cotrain,none", help="comma-separated --draft-mode modes")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES)
    )
    p.add_argument("--out", default="runs/bench_async_rl.json")
    return p.parse_intermixed_args(argv)


def measure(overrides: list[str], draft: str, mode: str, args, work: pathlib.Path) -> dict:
    """Medians of one train_rl run's steps after the first `args.skip`."""
    run_dir = work / f"{draft}-{mode}"
    every = [*overrides, *MODES[mode], f"rl.steps={args.steps}"]
    train_rl.main([*every, "--draft-mode", draft, "--run-dir", str(run_dir), "--quiet"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[args.skip :]
    batch = config_lib.load("demo", every).rl.batch
    for r in rows:
        r["tokens_per_s"] = r["response_length"] * batch / r["step_time"]
    out = {k: float(np.median([r[k] for r in rows])) for k in COLUMNS}
    return {"draft": draft, "mode": mode, "steps": len(rows), **out}


def table(results: list[dict]) -> str:
    """Markdown rows, with each mode's step-time speed-up over 'sync' of the same draft."""
    sync = {r["draft"]: r["step_time"] for r in results if r["mode"] == "sync"}
    lines = [
        "| draft | mode | step s | tokens/s | rollout s | train s | transfer ms | accepted "
        "| speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        speedup = sync[r["draft"]] / r["step_time"] if r["draft"] in sync else float("nan")
        lines.append(
            f"| {r['draft']} | {r['mode']} | {r['step_time']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['rollout_time']:.3f} | {r['train_time']:.3f} | {1e3 * r['transfer_time']:.1f} | "
            f"{r['accepted_length']:.2f} | {speedup:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if len(jax.devices()) != 2:
        raise SystemExit(
            f"this benchmark wants exactly two devices (one rollout, one training); "
            f"{len(jax.devices())} are visible (CUDA_VISIBLE_DEVICES picks two)."
        )
    overrides = [
        *(SMALL if args.small else LARGE),
        "rl.sft_steps=2",
        "rl.save_every=0",
        "rl.keep_checkpoints=1",
        *args.overrides,
    ]
    with tempfile.TemporaryDirectory() as work:
        results = [
            measure(overrides, draft, mode, args, pathlib.Path(work))
            for draft in args.drafts.split(",")
            for mode in args.modes.split(",")
        ]
    print(f"{jax.devices()[0].device_kind} x 2, overrides: {' '.join(overrides)}")
    print(table(results))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overrides": overrides, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    sys.exit(cli.run(main))
