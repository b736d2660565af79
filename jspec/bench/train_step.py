"""What co-training the draft adds to the RL train step: the step timed with no draft, a frozen
draft (its trunk pass, for the agreement metric) and a co-trained draft at several
training-time-test depths, on one packed batch of the run's shapes.

    python -m jspec.bench.train_step                        # configs/code-rl.yaml
    python -m jspec.bench.train_step --ttt-steps 0 1 3 --mean-response 145 rl.loss_chunk=512

The batch: rl.batch sequences of prompts of rl-experiment size (--prompt-len tokens) and responses
of lengths drawn around --mean-response (at most rollout.max_new_tokens), packed as train_rl packs
them. Random weights: only the time is measured. Prints a Markdown table (median seconds over
--steps after two warm-up steps, and the ratio to the step with no draft) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np

from jspec import config as config_lib
from jspec import tokenizers
from jspec.jobs import cli, train_rl
from jspec.rl.state import init_state, trained_groups


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--config", default="code-rl")
    p.add_argument("--ttt-steps", type=int, nargs="+", default=[0, 1, 3])
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--mean-response", type=float, default=145.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_train_step.json"))
    return p.parse_intermixed_args(argv)


def batch(run: train_rl.Run, prompt_len: int, mean_response: float, seed: int = 0):
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


def time_step(cfg, mode: str, args) -> tuple[float, int]:
    """The median seconds of one train step of `mode` ('none', 'frozen', 'cotrain'), and the
    batch's rows."""
    run = train_rl.Run((cfg, tokenizers.ByteTokenizer(), args.prompt_len), mode)
    trained = trained_groups(mode, run.networks.draft is not None)
    tx, step = run.step_fn("grpo", trained, cfg.rl.learning_rate, cfg.rl.batch)
    state = init_state(run.networks, run.initial_params, tx, trained, seed=0, reference=False)
    data, rows = batch(run, args.prompt_len, args.mean_response)
    times = []
    for _ in range(2 + args.steps):
        start = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, data))
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:])), rows


def main(argv=None):
    args = parse_args(argv)
    cfg = config_lib.load(args.config, args.overrides)
    variants = {"none": (cfg, "none"), "frozen": (cfg, "frozen")}
    for k in args.ttt_steps:
        rl = dataclasses.replace(cfg.rl, ttt_steps=k)
        variants[f"cotrain, {k} TTT steps"] = (dataclasses.replace(cfg, rl=rl), "cotrain")
    timed = {name: time_step(c, mode, args) for name, (c, mode) in variants.items()}
    base = timed["none"][0]
    rows = [
        {"variant": name, "seconds": s, "over_none": s / base, "rows": n}
        for name, (s, n) in timed.items()
    ]
    print("| train step | seconds | over none | packed rows |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['seconds']:.4f} | {r['over_none']:.2f} | {r['rows']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(cli.run(main))
