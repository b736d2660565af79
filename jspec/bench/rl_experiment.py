"""The report's experiment on a trained policy: RL with no speculation, with a frozen draft and with
the co-trained draft, from the same checkpoint and seeds; the table and the plot of what differs.

    python -m jspec.jobs.train_code_lm --config code-rl --run-dir runs/code --steps 600 \\
        --draft-steps 600
    python -m jspec.bench.rl_experiment --policy runs/code --out runs/rl-experiment
    python -m jspec.bench.rl_experiment --policy runs/code --out runs/rl-experiment \\
        --stop-after 9 rl.steps=150        # under a time limit: run again to go on

One `train_rl` command (`--config code-rl` by default, the policy `rl.policy=POLICY`, the draft
`rollout.draft.path=POLICY/draft` or fresh, `seed=--warm-seed`) warm-starts policy and draft on the
task's worked answers with `rl.steps=0` and exports them to OUT/warm/export; then one `train_rl`
command per mode and seed starts from that export (no warm start of its own), in
OUT/<mode>-seed<N>: every run starts from the very same weights, and the seeds differ in RL alone
(problems and samples). A run that stops (at `--stop-after`, exit status 75, or killed) resumes
from its checkpoint when this command runs again, and a finished run is not run twice, so the
runs may be spread over several commands (`--seeds 1 --modes none cotrain` adds a second seed of
those two). The no-speculation runs decode plainly (the fastest plain path, not the speculative
loop with an empty tree), with the same batch, prompts, lengths and temperature. When every run of
the command is done, OUT/summary.json and OUT/summary.md hold the table of every run in OUT (each
mode's seeds pooled) and OUT/rl_experiment.png the plot: accepted length (co-trained and frozen),
reward (all three) and rollout tokens/s against step.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np

from jspec.jobs import cli, train_rl, trainer

MODES = ("none", "frozen", "cotrain")
FIRST, LAST, SPEED = 10, 30, 50  # steps: the first, the last (reward, acceptance), the last (time)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. rl.steps=20")
    p.add_argument("--policy", required=True, help="a train_code_lm run directory (or HF model)")
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-3 draft directory (default POLICY/draft if any, else fresh)",
    )
    p.add_argument("--config", default="code-rl")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/rl-experiment"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="of the RL runs")
    p.add_argument("--warm-seed", type=int, default=0, help="of the one warm start")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--stop-after", type=cli.at_least(0, float), default=None, metavar="MINUTES")
    p.add_argument("--compilation-cache", default=None, help="train_rl's (default: its own)")
    return p.parse_intermixed_args(argv)


def run_dir(out: pathlib.Path, mode: str, seed: int) -> pathlib.Path:
    return out / f"{mode}-seed{seed}"


def run_all(args) -> None:
    """The warm start, then every (mode, seed) run from it, each resumed where it stopped; at the
    time limit, the run in progress saves and this command exits with status 75
    (`trainer.Stopped`)."""
    limits = trainer.Limits(minutes=args.stop_after)
    draft = args.draft or pathlib.Path(args.policy) / "draft"
    draft = draft if pathlib.Path(draft).is_dir() else None  # None: a fresh draft
    warm = args.out / "warm"
    start = [f"rl.policy={args.policy}", f"seed={args.warm_seed}", *args.overrides, "rl.steps=0"]
    start += [f"rollout.draft.path={draft}"] * (draft is not None)
    train(args, limits, "cotrain", warm, start)
    exported = warm / train_rl.EXPORT
    for seed in args.seeds:
        for mode in args.modes:
            # After the caller's overrides: every mode starts from the warm start's weights.
            overrides = [*args.overrides, f"rl.policy={exported / 'policy'}", f"seed={seed}"]
            overrides += ["rl.sft_steps=0"]
            if mode != "none":
                overrides.append(f"rollout.draft.path={exported / 'draft'}")
            train(args, limits, mode, run_dir(args.out, mode, seed), overrides)


def train(args, limits: trainer.Limits, mode: str, directory: pathlib.Path, overrides) -> None:
    """One `train_rl` run in `directory`, within what is left of the time limit."""
    left = limits.minutes_left()
    if left is not None and left <= 0:
        raise trainer.Stopped(f"the time limit (--stop-after {args.stop_after}) is past")
    flags = ["--config", args.config, "--draft-mode", mode, "--quiet", "--run-dir", str(directory)]
    if args.compilation_cache is not None:
        flags += ["--compilation-cache", args.compilation_cache]
    if left is not None:
        flags += ["--stop-after", f"{left:.3f}"]
    print(f"{directory.name}: {' '.join(overrides)}", flush=True)
    train_rl.main([*flags, *overrides])


def runs_of(out: pathlib.Path) -> dict[str, list[list[dict]]]:
    """Each mode's runs in `out` with metrics (its seeds, in order), modes in MODES order."""
    found = {m: sorted(out.glob(f"{m}-seed*/metrics.jsonl")) for m in MODES}
    return {m: [read(path.parent) for path in paths] for m, paths in found.items() if paths}


def read(path: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r]


def mean_se(values: np.ndarray) -> tuple[float, float]:
    values = np.asarray(values, float)
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(values.size))


def _mean(runs: list[list[dict]], key: str, steps: slice) -> float | None:
    """The mean of `key` over `steps` of each run (None where the runs do not log it)."""
    values = [r[key] for run in runs for r in run[steps] if key in r]
    return float(np.mean(values)) if values else None


def _per_stage(runs: list[list[dict]], steps: slice) -> str | None:
    """Tokens a row emits per loop trip in each stage (the batch, then each bucket), over `steps`:
    what each stage's tree earned ('-' where a stage never ran; None where runs do not log it)."""
    rows = [r for run in runs for r in run[steps] if "stage_emitted" in r]
    if not rows:
        return None
    emitted = np.sum([r["stage_emitted"] for r in rows], axis=0)
    row_steps = np.sum([r["stage_row_steps"] for r in rows], axis=0)
    per_trip = [f"{e / n:.2f}" if n else "-" for e, n in zip(emitted, row_steps, strict=True)]
    return " / ".join(per_trip)


def summarize_mode(runs: list[list[dict]]) -> dict:
    """One mode's figures, its seeds pooled: step slices FIRST, LAST and SPEED of each run."""
    column = lambda key, sl: np.concatenate([[r[key] for r in run[sl]] for run in runs])
    first, last, speed = slice(0, FIRST), slice(-LAST, None), slice(-SPEED, None)
    reward_first, reward_last = mean_se(column("reward", first)), mean_se(column("reward", last))
    return {
        "seeds": len(runs),
        "steps": min(len(run) for run in runs),
        "reward_first": reward_first,
        "reward_last": reward_last,
        "accepted_first": float(column("accepted_length", first).mean()),
        "accepted_last": float(column("accepted_length", last).mean()),
        "agreement_last": _mean(runs, "agreement", last),
        "response_length": float(column("response_length", speed).mean()),
        # Medians: a step that compiles (a run's first, and the first after each resume) takes
        # seconds more, which a mean over the last steps of a short run would carry.
        **{k: float(np.median(column(k, speed))) for k in TIMES},
        "other_time": float(
            np.median(column("step_time", speed) - sum(column(k, speed) for k in TIMES[:-1]))
        ),
        "rollout_tokens_per_s": float(np.median(column("rollout_tokens_per_s", speed))),
        "verify_steps": float(np.median(column("verify_steps", speed))),
        # Seconds of rollout per loop trip: what a trip costs, prefill and host work included.
        "rollout_ms_per_verify_step": float(
            1e3 * np.median(column("rollout_time", speed) / column("verify_steps", speed))
        ),
        "stage_tokens_per_trip": _per_stage(runs, speed),
    }


TIMES = ("rollout_time", "score_time", "pack_time", "train_time", "transfer_time", "step_time")


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    """The table's figures by mode (`runs_of`), and the ratios the experiment is for."""
    table = {m: summarize_mode(mode_runs) for m, mode_runs in runs.items()}
    if "none" in table:
        base = table["none"]
        for m in table:
            row = table[m]
            row["rollout_speedup"] = base["rollout_time"] / row["rollout_time"]
            row["step_speedup"] = base["step_time"] / row["step_time"]
            row["train_step_over_none"] = row["train_time"] / base["train_time"]
            a, b = row["reward_last"], base["reward_last"]
            se = math.hypot(a[1], b[1])  # nan or 0 for too few steps to tell
            row["reward_last_difference_in_se"] = (a[0] - b[0]) / se if se > 0 else math.nan
    return table


def markdown(table: dict) -> str:
    fmt = lambda v: (
        f"{v[0]:.3f} ± {v[1]:.3f}"
        if isinstance(v, tuple | list)
        else ("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
    )
    keys = list(next(iter(table.values())))
    lines = ["| figure | " + " | ".join(table) + " |", "| --- |" + " --- |" * len(table)]
    lines += [f"| {k} | " + " | ".join(fmt(table[m].get(k)) for m in table) + " |" for k in keys]
    return "\n".join(lines) + "\n"


COLORS = {"none": "C0", "frozen": "C1", "cotrain": "C2"}  # a mode's colour in every panel
PANELS = (
    ("accepted_length", "mean accepted length", ("frozen", "cotrain")),
    ("reward", "reward", MODES),
    ("rollout_tokens_per_s", "rollout tokens/s", MODES),
)


def plot(out: pathlib.Path, runs: dict[str, list[list[dict]]]) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (key, title, shown) in zip(axes, PANELS, strict=True):
        for mode in (m for m in runs if m in shown):
            n = min(map(len, runs[mode]))
            values = np.asarray([[r[key] for r in run[:n]] for run in runs[mode]])
            seeds = f"{len(runs[mode])} seed" + "s" * (len(runs[mode]) > 1)
            ax.plot(np.arange(n), values.mean(0), color=COLORS[mode], label=f"{mode} ({seeds})")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "rl_experiment.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    args = parse_args(argv)
    with trainer.resumable(print):
        run_all(args)
    runs = runs_of(args.out)
    table = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(table))
    print(markdown(table), flush=True)
    print(f"wrote {args.out / 'summary.json'}, {plot(args.out, runs)}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
