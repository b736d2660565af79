"""Plots runs of jspec.jobs.train_rl against step: mean accepted length, draft agreement, reward.

    python -m jspec.jobs.plot_runs runs/demo-cotrain runs/demo-frozen --out runs/compare.png
    python -m jspec.jobs.plot_runs runs/shift-*-seed* --out shift.png     # seeds of a run pooled

Each run directory holds a metrics.jsonl. Runs whose names differ only by a trailing `-seed<N>`
are drawn as one line (the mean over seeds) with a band from the lowest to the highest seed.
Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections import defaultdict

import numpy as np

from jspec.config import ConfigError
from jspec.jobs import cli, trainer

PANELS = (
    ("accepted_length", "mean accepted length"),
    ("agreement", "draft top-1 agreement"),
    ("reward", "reward"),
)


def read(run_dir: pathlib.Path) -> dict[str, np.ndarray]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} not found; pass run directories of train_rl (--run-dir).")
    rows = [r for r in trainer.read_metrics(path) if r]
    out = {"step": np.asarray([r["step"] for r in rows])}
    for key, _ in PANELS:
        out[key] = np.asarray([r.get(key, np.nan) for r in rows], dtype=float)
    return out


def group(run_dirs: list[pathlib.Path]) -> dict[str, list[dict]]:
    """Runs by label: the directory name without a trailing -seed<N>."""
    groups = defaultdict(list)
    for d in run_dirs:
        groups[re.sub(r"-seed\d+$", "", d.name)].append(read(d))
    return groups


def plot(run_dirs: list[pathlib.Path], out: pathlib.Path, shift_step: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for label, runs in group(run_dirs).items():
        n = min(len(r["step"]) for r in runs)
        step = runs[0]["step"][:n]
        for ax, (key, title) in zip(axes, PANELS, strict=True):
            values = np.stack([r[key][:n] for r in runs])
            line = ax.plot(step, values.mean(axis=0), label=f"{label} ({len(runs)})")[0]
            if len(runs) > 1:
                ax.fill_between(
                    step, values.min(0), values.max(0), alpha=0.2, color=line.get_color()
                )
            ax.set_title(title)
            ax.set_xlabel("RL step")
    for ax in axes:
        if shift_step is not None:
            ax.axvline(shift_step, color="grey", linestyle=":", label="task shift")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=pathlib.Path, help="run directories (metrics.jsonl)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/runs.png"))
    p.add_argument("--shift-step", type=int, default=None, help="draw the task shift at this step")
    args = p.parse_args(argv)
    plot(args.runs, args.out, args.shift_step)


if __name__ == "__main__":
    sys.exit(cli.run(main))
