"""Long-tailed rollouts: an RL step's batch generated with and without compaction into buckets,
plainly and speculatively, on the run's own policy, draft, prompts and temperature.

    python -m jspec.bench.long_tail rl.policy=runs/code rollout.draft.path=runs/code/draft \\
        rl.task.spread=5 'rollout.buckets=[{rows: 32}, {rows: 8}]'

The batch is an RL step's (`rl.prompts` problems of `rl.task`, `rl.group_size` responses each,
at `rollout.temperature`); with `rl.task.spread` most responses are short and a few long, as in
RL. Each variant generates the batches of `--steps` RL steps (one more first, which compiles),
and the table gives their mean rollout seconds, tokens/s, verify steps (and how many of them each
stage ran: the whole batch, then each bucket), the share of decoded row steps that emitted (busy),
the accepted length, the tokens a row emits a step, idle steps counted (and in each stage: what a
bucket's deeper tree buys), and the ratio to the speculative rollout with no compaction; the JSON
adds the share of verify steps whose accepted path reached each depth.
`--same-length` adds the variants with the end token ignored, so that every row runs to
rollout.max_new_tokens (the batch compaction cannot shorten). `--answer-lengths` runs every response
exactly as long as its problem's worked answer (the end token ignored): the task's own long tail,
the same for any policy (a warm-started one answers at about these lengths), so that a model never
trained on the task (the 1.4B code model) decodes an RL step's lengths. `--partial-rows K` adds
partial rollouts (`rl.partial_rows`, `jspec.rl.partial`): each step's rollout returns once at most K
rows run, and those go on in the next step's; its tokens/s counts the tokens each rollout generated.
The programs compiled for the rollout are counted: one per variant, whatever the buckets (they are
stages of one program). `--profile DIR` traces one more rollout of each variant (not the partial
ones) and prints its GPU kernels: their time against the rollout's, the launches a verify step, the
heaviest kernels. Prints a Markdown table and writes JSON.
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
from jspec import hosts
from jspec.bench.kernel_profile import gpu_kernels
from jspec.jobs import cli, rl_run
from jspec.rl import partial, tasks
from jspec.sampler import generate
from jspec.sampler.generation import compiled_programs, stages


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides (rollout.buckets too)")
    p.add_argument("--config", default="code-rl")
    p.add_argument(
        "--steps", type=cli.at_least(1), default=3, help="RL steps' batches timed per variant"
    )
    p.add_argument("--same-length", action="store_true", help="also every row at the length cap")
    p.add_argument(
        "--partial-rows", type=cli.at_least(0), default=0, help="also partial rollouts of K rows"
    )
    p.add_argument(
        "--answer-lengths", action="store_true", help="each response as long as its worked answer"
    )
    p.add_argument("--profile", metavar="DIR", help="also trace each variant's GPU kernels")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_long_tail.json"))
    return p.parse_intermixed_args(argv)


def variants(rollout: config_lib.RolloutConfig, args: argparse.Namespace) -> dict:
    """(config, speculative, the variant it is compared with, partial rows) of each variant, by
    name: the speculative rollout with no buckets of the same lengths."""
    same_length, partial_rows = args.same_length, args.partial_rows
    if not rollout.buckets:
        raise config_lib.ConfigError(
            "rollout.buckets is empty: name the buckets compaction moves the rows into, e.g. "
            "'rollout.buckets=[{rows: 32}, {rows: 8}]'."
        )
    if args.answer_lengths and (same_length or partial_rows):
        raise config_lib.ConfigError(
            "--answer-lengths sets every response's length: drop --same-length and --partial-rows."
        )
    whole = dataclasses.replace(rollout, buckets=())
    first = None if args.answer_lengths else rollout.eos_id
    out = {}
    for suffix, eos in [("", first)] + [(", same length", None)] * same_length:
        for kind, speculative in (("speculative", True), ("plain", False)):
            for name, config in ((kind, whole), (f"{kind} + buckets", rollout)):
                config = dataclasses.replace(config, eos_id=eos)
                out[name + suffix] = (config, speculative, f"speculative{suffix}", 0)
    if partial_rows:
        out[f"speculative + buckets, partial {partial_rows}"] = (
            rollout,
            True,
            "speculative",
            partial_rows,
        )
    return out


def batches(run: rl_run.Run, steps: int, answer_lengths: bool) -> list:
    """The prompts, their lengths and (with `answer_lengths`: their worked answers' lengths, at
    most rollout.max_new_tokens; else None) the responses' budgets of RL steps 0..steps, placed as
    the sampler places them."""
    rl, longest, out = run.rl, run.cfg.rollout.max_new_tokens, []
    place = lambda x: None if x is None else hosts.global_array(run.decode_rows, x, rl.batch)
    for step in range(steps + 1):
        problems = tasks.problems(rl.task, step, rl.prompts, run.cfg.seed)
        group = [p for p in problems for _ in range(rl.group_size)]
        encoded = tasks.encode_prompts(run.tokenizer, group, run.prompt_width)
        budgets = tasks.encode_answers(run.tokenizer, group, longest)[1] if answer_lengths else None
        out.append([place(x) for x in (*encoded, budgets)])
    return out


def time_variant(run: rl_run.Run, models, data, config, speculative: bool, rows: int) -> dict:
    """Mean seconds and statistics of the rollouts of `data` after the first (which compiles);
    with `rows`, partial rollouts that leave at most that many rows running."""
    policy, draft = models
    draft = draft if speculative else None
    rl, seconds, tokens, stats = run.rl, [], 0, []
    shape = (run.prompt_width, config.max_new_tokens, rl.group_size)
    pool = partial.Pool(rows, *shape) if rows else None
    for step, (prompts, lengths, budgets) in enumerate(data):
        key = jax.random.fold_in(jax.random.key(run.cfg.seed), step)
        start = time.perf_counter()
        if pool is not None:
            inputs = (policy, draft, prompts, lengths, key)
            host = jax.device_get((prompts, lengths))
            out, _, generated = pool.rollout(inputs, config, step, 0, [None] * rl.batch, *host)
        else:
            inputs = (policy, draft, prompts, lengths, key, config)
            out = jax.block_until_ready(generate(*inputs, budgets=budgets))
            generated = int(np.sum(jax.device_get(out.lengths)))
        if step:
            seconds.append(time.perf_counter() - start)
            tokens += generated
            stats.append(jax.device_get(out.stats))
    total = jax.tree.map(lambda *x: np.sum(x, axis=0), *stats)  # the steps' counts pooled
    return {
        "seconds": float(np.mean(seconds)),
        "tokens_per_s": tokens / float(np.sum(seconds)),
        "mean_length": tokens / (len(seconds) * run.rl.batch),
        "iterations": int(total.iterations) / len(seconds),
        "iterations_by_stage": _iterations_by_stage(total, config, rl.batch, len(seconds), rows),
        "busy": total.busy(),
        "accepted_length": total.mean_accepted_length(),
        "tokens_per_row_step": total.tokens_per_row_step(),
        "tokens_per_row_step_by_stage": [
            total.tokens_per_row_step(i) for i in range(len(total.row_steps))
        ],
        "reached_depth": total.acceptance_per_depth().tolist(),
    }


def profile_variant(models, data, config, speculative: bool, log_dir: str) -> dict:
    """The GPU kernels of a rollout of the variant's second batch: their milliseconds against the
    rollout's (the rest is launch gaps and the host), launches a verify step, and the ten
    heaviest kernels (ms, launches)."""
    policy, draft = models
    prompts, lengths, budgets = data[1]
    inputs = (policy, draft if speculative else None, prompts, lengths, jax.random.key(0), config)
    run = lambda: generate(*inputs, budgets=budgets)
    start = time.perf_counter()  # compiled already, by time_variant
    iterations = int(jax.block_until_ready(run()).stats.iterations)
    rollout_ms = 1e3 * (time.perf_counter() - start)
    ms, launches = gpu_kernels(run, log_dir)
    profile = {
        "kernel_ms": sum(ms.values()),
        "rollout_ms": rollout_ms,
        "launches_per_verify_step": sum(launches.values()) / iterations,
        "heaviest": [(k, v, launches[k]) for k, v in ms.most_common(10)],
    }
    print(
        f"{log_dir}: kernels {profile['kernel_ms']:.1f} of {rollout_ms:.1f} ms, "
        f"{profile['launches_per_verify_step']:.0f} launches a verify step ({iterations})",
        file=sys.stderr,
    )
    for name, kernel_ms, n in profile["heaviest"]:
        print(f"  {kernel_ms:8.2f} ms {n:6d}x  {name[:90]}", file=sys.stderr)
    return profile


def _iterations_by_stage(total, config, batch: int, steps: int, partial_rows: int) -> list:
    """Mean verify steps of each stage (the whole batch, then each bucket reached); of partial
    rollouts only their sum, their batch growing with the rows carried in."""
    if partial_rows:
        return [int(total.iterations) / steps]
    rows = [r for r, _ in stages(config, batch)]
    return [int(n) / r / steps for n, r in zip(total.row_steps, rows, strict=True)]


def by_stage(total: float, stages: list, digits: int = 0) -> str:
    """A variant's figure, and each stage's where it ran several: '74 (30 + 44)'."""
    parts = f" ({' + '.join(f'{n:.{digits}f}' for n in stages)})" if len(stages) > 1 else ""
    return f"{total:.{digits}f}{parts}"


def main(argv=None):
    args = parse_args(argv)
    checked = rl_run.check(
        config_lib.load(args.config, args.overrides), "frozen", jax.device_count()
    )
    table = variants(checked[0].rollout, args)  # the rollout with the tokenizer's end token
    run = rl_run.Run(checked, "frozen")
    models = run.networks.models(run.initial_params)
    data = batches(run, args.steps, args.answer_lengths)
    timed, rows = {}, []
    for name, (config, speculative, base, partial_rows) in table.items():
        timed[name] = time_variant(run, models, data, config, speculative, partial_rows)
        if args.profile and not partial_rows:
            log_dir = f"{args.profile}/{name.replace(' ', '_').replace(',', '')}"
            timed[name]["profile"] = profile_variant(models, data, config, speculative, log_dir)
        print(f"{name}: {timed[name]['seconds']:.3f} s", file=sys.stderr)
        speedup = timed[base]["seconds"] / timed[name]["seconds"]
        rows.append({"variant": name, **timed[name], "speedup_over_speculative": speedup})
    print(
        "| rollout | seconds | tokens/s | mean length | verify steps | busy | accepted | "
        "tokens a row step | speedup over speculative |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        steps = by_stage(r["iterations"], r["iterations_by_stage"])
        per_row = by_stage(r["tokens_per_row_step"], r["tokens_per_row_step_by_stage"], 2)
        print(
            f"| {r['variant']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['mean_length']:.0f} | {steps} | {r['busy']:.2f} | {r['accepted_length']:.2f} | "
            f"{per_row} | {r['speedup_over_speculative']:.2f}x |"
        )
    programs = compiled_programs()
    print(f"rollout programs compiled: {programs} (variants: {len(rows)})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"config": args.config, "overrides": args.overrides, "programs": programs}
    args.out.write_text(json.dumps({**summary, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(cli.run(main))
