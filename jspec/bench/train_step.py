"""What co-training the draft adds to the RL train step: the step timed with no draft, a frozen
draft (its trunk pass, for the agreement metric) and a co-trained draft at several
training-time-test depths, on one packed batch of the run's shapes; each step split into its
optimizer update (timed alone) and its forward and backward, and the policy's model FLOPs
(`jspec.bench.policy_step.model_flops`) over the forward and backward of the step with no draft
against the matmul ceiling.

    python -m jspec.bench.train_step                        # configs/code-rl.yaml
    python -m jspec.bench.train_step --ttt-steps 0 1 3 --mean-response 145 rl.loss_chunk=512

The batch: rl.batch sequences of prompts of rl-experiment size (--prompt-len tokens) and responses
of lengths drawn around --mean-response (at most rollout.max_new_tokens), packed as train_rl packs
them. Random weights: only the time is measured. Prints a Markdown table (median seconds over
--steps after two warm-up steps, the ratio to the step with no draft, the split) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import config as config_lib
from jspec import tokenizers
from jspec.bench.policy_step import MATMUL_CEILING, model_flops
from jspec.jobs import cli, rl_run
from jspec.rl.state import init_state, trained_groups
from jspec.rl.train import apply_gradients


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--config", default="code-rl")
    p.add_argument("--ttt-steps", type=cli.at_least(0), nargs="+", default=[0, 1, 3])
    p.add_argument("--prompt-len", type=cli.at_least(1), default=160)
    p.add_argument("--mean-response", type=cli.positive, default=145.0)
    p.add_argument("--steps", type=cli.at_least(1), default=5)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_train_step.json"))
    return p.parse_intermixed_args(argv)


def batch(run: rl_run.Run, prompt_len: int, mean_response: float, seed: int = 0):
    """A packed batch of the run's shapes: rl.batch random sequences, packed as train_rl packs
    them (in the fewest of rl.packed_rows rows that hold them)."""
    rl, new = run.rl, run.cfg.rollout.max_new_tokens
    rng = np.random.default_rng(seed)
    b, v = rl.batch, run.cfg.model.vocab_size
    lengths = np.clip(rng.exponential(mean_response, b).astype(np.int32), 1, new)
    prompts = rng.integers(0, v, (b, prompt_len), dtype=np.int32)
    responses = rng.integers(0, v, (b, new), dtype=np.int32)
    advantages = rng.standard_normal(b).astype(np.float32)
    logprobs = np.full((b, new), -2.0, np.float32)
    prompt_lengths = np.full(b, prompt_len, np.int32)
    packed, rows = run.pack(prompts, prompt_lengths, responses, lengths, logprobs, advantages)
    return run.put(packed, 0, rows), rows


def median_seconds(fn, state, steps: int):
    """Median seconds of `state = fn(state)` over `steps` calls after two (compile, warm-up)."""
    times = []
    for _ in range(2 + steps):
        start = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:])), state


def optimizer_update(tx, trained):
    """state -> state after one update of `tx` from gradients of ones: the step's optimizer part."""

    def update(state):
        grads = jax.tree.map(jnp.ones_like, {k: state.params[k] for k in trained})
        return apply_gradients(tx, state, grads)

    return jax.jit(update, donate_argnums=0)


def time_step(cfg, mode: str, args) -> dict:
    """One train step of `mode` ('none', 'frozen', 'cotrain'): median seconds of the step and of
    its optimizer update alone, the batch's rows and the policy's model FLOPs over it."""
    run = rl_run.Run((cfg, tokenizers.ByteTokenizer(), args.prompt_len), mode)
    trained = trained_groups(mode, run.networks.draft is not None)
    tx, step = run.step_fn("grpo", trained, cfg.rl.learning_rate, cfg.rl.batch)
    state = init_state(run.networks, run.initial_params, tx, trained, seed=0, reference=False)
    data, rows = batch(run, args.prompt_len, args.mean_response)
    seconds, state = median_seconds(lambda s: step(s, data)[0], state, args.steps)
    optimizer, _ = median_seconds(optimizer_update(tx, trained), state, args.steps)
    seg, pos = jax.device_get((data.segment_ids, data.positions))
    flops = model_flops(cfg.model, np.asarray(seg), np.asarray(pos))
    return dict(seconds=seconds, optimizer=optimizer, rows=rows, policy_flops=flops)


def main(argv=None):
    args = parse_args(argv)
    cfg = config_lib.load(args.config, args.overrides)
    variants = {"none": (cfg, "none"), "frozen": (cfg, "frozen")}
    for k in args.ttt_steps:
        rl = dataclasses.replace(cfg.rl, ttt_steps=k)
        variants[f"cotrain, {k} TTT steps"] = (dataclasses.replace(cfg, rl=rl), "cotrain")
    timed = {name: time_step(c, mode, args) for name, (c, mode) in variants.items()}
    rows, policy = split(timed)
    print(
        "| train step | seconds | over none | optimizer | forward + backward | the draft's part "
        "| packed rows |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        print(
            f"| {r['variant']} | {r['seconds']:.4f} | {r['over_none']:.2f} | "
            f"{r['optimizer']:.4f} | {r['forward_backward']:.4f} | {r['draft']:.4f} | "
            f"{r['rows']} |"
        )
    print(
        f"policy forward + backward: {policy['tflop']:.2f} model TFLOP in {policy['seconds']:.4f} "
        f"s, {policy['tflop_per_s']:.0f} TFLOP/s, {100 * policy['of_ceiling']:.0f}% of the "
        f"{MATMUL_CEILING / 1e12:.0f} TFLOP/s matmul ceiling"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"config": args.config, "rows": rows, "policy": policy}
    args.out.write_text(json.dumps(out, indent=2) + "\n")


def split(timed: dict) -> tuple[list[dict], dict]:
    """Each variant's step split into its optimizer update and its forward and backward, and the
    draft's part of the latter (over the step with no draft's); and the policy's model FLOP/s
    over the forward and backward of the step with no draft."""
    none = timed["none"]
    policy = none["seconds"] - none["optimizer"]
    rows = []
    for name, t in timed.items():
        forward_backward = t["seconds"] - t["optimizer"]
        rows.append(
            dict(
                variant=name,
                seconds=t["seconds"],
                over_none=t["seconds"] / none["seconds"],
                optimizer=t["optimizer"],
                forward_backward=forward_backward,
                draft=forward_backward - policy,
                rows=t["rows"],
            )
        )
    rate = none["policy_flops"] / policy
    return rows, dict(
        tflop=none["policy_flops"] / 1e12,
        seconds=policy,
        tflop_per_s=rate / 1e12,
        of_ceiling=rate / MATMUL_CEILING,
    )


if __name__ == "__main__":
    sys.exit(cli.run(main))
