"""The machinery around a loop of train steps that both training jobs share (`train_rl`'s RL loop,
each stage of `train_code_lm`): checkpoints that heal and check the config on resume
(`jspec.rl.checkpoints.Checkpoints`), metrics.jsonl and TensorBoard events (`Metrics`), and the
run's limits (`Limits`), which stop a loop with its step saved: the job then exits with status
`EXIT_RESUME` (75), and the same command resumes it.

The flags (`add_arguments`), one meaning in every job:
    --stop-after MINUTES    a time limit, from the job's start: the loop in training saves the
                            step it is at and the job exits 75
    --stop-after-steps N    the same after N train steps of this run (over all its loops)
    --allow-config-change   resume although the config differs from the checkpoint's in a field
                            that changes what the run computes; the fields are listed
A limit never stops a run before its first step, so each run makes progress.

A loop's directory (`TrainLoop`) is laid out as a `train_rl` run directory: checkpoints/,
metrics.jsonl (one line a step, rewritten from the resumed step on), tensorboard/ (when
tensorboardX is installed) and, once a checkpoint did not restore, corrupt/ and checkpoints.log.
The loop's body stays the job's own (a GRPO step is not a supervised step):

    loop = TrainLoop(directory, config, total=steps, limits=Limits.from_args(args))
    with resumable(print), loop:
        state, done = loop.resume(lambda: fresh) or (fresh, 0)
        for i in range(done, steps):
            state, metrics = train_step(state, batches(i))
            loop.step_done(i + 1, state, metrics)  # saves when due; at a limit, saves and stops

On many hosts every process runs the loop and takes part in each save; process 0 writes the
metrics, and the time-based decisions (a limit, a save every few minutes) are process 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jspec import hosts
from jspec.config import ConfigError
from jspec.jobs import cli
from jspec.rl.checkpoints import SAFE_TO_CHANGE, SHAPED_BY, Checkpoints

EXIT_RESUME = 75  # the exit status of a run stopped at a limit (EX_TEMPFAIL: run it again)

State = TypeVar("State")


class Stopped(Exception):
    """A loop stopped at the run's limit, its step saved (or before a loop began)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training jobs' flags of limits and resumes (the module's docstring)."""
    parser.add_argument(
        "--stop-after",
        type=cli.at_least(0, float),
        metavar="MINUTES",
        help="a time limit: once this many minutes have passed, the loop in training saves its "
        f"step and the run exits with status {EXIT_RESUME}; the same command resumes it",
    )
    parser.add_argument(
        "--stop-after-steps",
        type=cli.at_least(1),
        metavar="N",
        help=f"stop after N train steps of this run, saved, with status {EXIT_RESUME}; the same "
        "command resumes it",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume although the config differs from the checkpoint's in a field that changes "
        "what the run computes (seed, learning rates, ...); the fields are listed",
    )


def agreed(flag: bool) -> bool:
    """`flag` as process 0 sees it, on every process (a clock's decision must be the same)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


class Limits:
    """The run's limits, the same across its loops: a time (`minutes` from the start; None: none)
    and a number of train steps (`steps`; None: none), counted in `taken`."""

    def __init__(self, minutes: float | None = None, steps: int | None = None):
        self.start = time.perf_counter()
        self.deadline = None if minutes is None else self.start + 60 * minutes
        self.steps, self.taken = steps, 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(args.stop_after, args.stop_after_steps)

    def stamp(self) -> str:
        """Where in the run a line is said: '[N s into the run]'."""
        return f"[{time.perf_counter() - self.start:.0f} s into the run]"

    def reached(self) -> str | None:
        """The limit that stops the run now, None while there is none (or no step was taken)."""
        if self.taken == 0:
            return None
        if self.steps is not None and self.taken >= self.steps:
            return f"the step limit (--stop-after-steps {self.steps})"
        if self.deadline is not None and agreed(time.perf_counter() >= self.deadline):
            return "the time limit"
        return None

    def minutes_left(self) -> float | None:
        """Minutes to the time limit (None: none), for a run that hands what is left to another."""
        return None if self.deadline is None else (self.deadline - time.perf_counter()) / 60

    def last_step(self, first: int, total: int) -> int:
        """Where a loop from step `first` of `total` ends, unless the time limit comes first."""
        return total if self.steps is None else min(total, first + self.steps - self.taken)

    def check(self, before: str) -> None:
        """Raises Stopped when a limit is reached ahead of `before` (what would come next)."""
        if (limit := self.reached()) is not None:
            raise Stopped(f"{limit} came before {before} {self.stamp()}")


@contextlib.contextmanager
def resumable(say: Callable[[str], None]):
    """A run stopped at a limit (`Stopped`) says so, '...; run the same command to resume', and
    exits with status EXIT_RESUME."""
    try:
        yield
    except Stopped as stop:
        say(f"{stop}; run the same command to resume")
        raise SystemExit(EXIT_RESUME) from None


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The rows of a metrics.jsonl (none if there is no file). A last line that does not parse
    is a write cut short (a process killed mid-line, a full disk): left out, so that the run
    resumes and writes that step again."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    rows = [json.loads(ln) for ln in lines[:-1]]
    with contextlib.suppress(json.JSONDecodeError):
        rows += [json.loads(ln) for ln in lines[-1:]]
    return rows


class Metrics:
    """`directory`/metrics.jsonl, one line a step (the lines of the steps from the first one
    written on are dropped: a resumed run writes them again), and TensorBoard events of its float
    values in `directory`/tensorboard when tensorboardX is installed. Rows wait, as they are
    (device arrays too), for `flush`, which reads them off the devices at once."""

    def __init__(self, directory: pathlib.Path):
        self.path = directory / "metrics.jsonl"  # as TrainLoop.metrics_path
        self.board_dir = directory / "tensorboard"
        self.pending: list[tuple[int, dict]] = []
        self.board, self.opened = None, False

    def write(self, step: int, metrics: dict) -> None:
        self.pending.append((step, dict(metrics)))

    def flush(self) -> None:
        if not self.pending:
            return
        rows, self.pending = jax.device_get(self.pending), []
        if not self.opened:
            self._open(rows[0][0])
        with self.path.open("a") as f:
            for step, metrics in rows:
                metrics = {k: _plain(v) for k, v in metrics.items()}
                f.write(json.dumps({"step": step, **metrics}) + "\n")
                for k, v in metrics.items():
                    if self.board is not None and isinstance(v, float):
                        self.board.add_scalar(k, v, step)

    def close(self) -> None:
        self.flush()
        if self.board is not None:
            self.board.close()

    def _open(self, first: int) -> None:
        kept = [row for row in read_metrics(self.path) if row["step"] < first]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.opened = True
        try:
            from tensorboardX import SummaryWriter

            self.board = SummaryWriter(str(self.board_dir))
        except ImportError:
            self.board = None


def _plain(value):
    return value.item() if isinstance(value, np.ndarray | np.generic) else value


class TrainLoop:
    """The checkpoints, metrics and limits of one loop of `total` train steps in `directory`.

    `config` (a JSON dict) is saved beside each checkpoint and checked on resume against
    `shaped_by` and `safe_to_change` (`Checkpoints`; the defaults are an RL run's), at once: a
    resume the config refuses fails before anything is built. A checkpoint is saved every
    `save_every` steps (0: never), every `save_minutes` minutes (None: never), at the last step
    when `save_last`, and at a limit; the newest `keep` are kept. `name` starts the line of a stop.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        config: dict,
        *,
        total: int,
        limits: Limits,
        keep: int = 3,
        save_every: int = 0,
        save_minutes: float | None = None,
        save_last: bool = True,
        allow_changes: bool = False,
        log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
        name: str = "",
        shaped_by: tuple[str, ...] = SHAPED_BY,
        safe_to_change: tuple[str, ...] = SAFE_TO_CHANGE,
    ):
        self.directory, self.metrics_path = directory, directory / "metrics.jsonl"
        self.checkpoints = Checkpoints(
            directory / "checkpoints",
            config,
            keep,
            allow_changes=allow_changes,
            log=log,
            shaped_by=shaped_by,
            safe_to_change=safe_to_change,
        )
        self.checkpoints.check_resume()
        self.metrics = Metrics(directory) if hosts.is_main() else None
        self.total, self.limits, self.name, self.keep = total, limits, name, keep
        self._beside: list[tuple[str, Callable[[int], bytes]]] = []  # `keep_beside`'s files
        self.save_every, self.save_minutes, self.save_last = save_every, save_minutes, save_last
        self.last_save = time.perf_counter()
        self.removed = False

    def resume(self, template: Callable[[], State]) -> tuple[State, int] | None:
        """(state, steps done) of the newest checkpoint that restores, placed like `template()`
        (called only when there are checkpoints); None when there are none. A ConfigError when
        none of them restores (each was reported and set aside)."""
        steps = self.checkpoints.steps()
        if not steps:
            return None
        restored = self.checkpoints.restore_latest(template())
        if restored is None:
            raise ConfigError(
                f"none of the {len(steps)} checkpoints in {self.checkpoints.directory} restores "
                "(each is reported above and was moved aside); run again to start the run afresh."
            )
        self.last_save = time.perf_counter()
        return restored

    def flush(self) -> None:
        """Writes the metrics of the steps done so far (process 0 writes them)."""
        if self.metrics is not None:
            self.metrics.flush()

    def save(self, done: int, state) -> None:
        """Starts the async save of `state` after `done` steps (the metrics, and the files kept
        beside it, written first)."""
        self.flush()
        for name, snapshot in self._beside:
            self._write_beside(name, done, snapshot(done))
        self.checkpoints.save(done, state)
        self.last_save = time.perf_counter()

    def beside(self, name: str, done: int) -> pathlib.Path:
        """Where the file `name` (such as 'partial.pkl') of the checkpoint after `done` steps is
        kept: what the run holds outside its TrainState, which a resumed run takes up again."""
        name = pathlib.PurePath(name)
        return self.directory / name.stem / f"{done}{name.suffix}"

    def keep_beside(self, name: str, snapshot: Callable[[int], bytes]) -> None:
        """With each save after `done` steps, `snapshot(done)` written to `beside(name, done)`."""
        self._beside.append((name, snapshot))

    def _write_beside(self, name: str, done: int, data: bytes) -> None:
        """Whole or not at all; the newest `keep` + 1 kept (the checkpoints' and the one before)."""
        path = self.beside(name, done)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_bytes(data)
        partial.replace(path)
        saved = sorted(path.parent.glob(f"*{path.suffix}"), key=lambda p: int(p.stem))
        for old in saved[: -(self.keep + 1)]:
            old.unlink()

    def step_done(self, done: int, state, metrics: dict | None = None, *, flush: bool = True):
        """After the train step that made `state`, the `done`th: its metrics written as step
        `done - 1` (read off the devices now when `flush`, else at the next flush or save), a
        checkpoint saved when one is due; at a limit, saved and raises Stopped."""
        if self.metrics is not None and metrics is not None:
            self.metrics.write(done - 1, metrics)
            if flush:
                self.metrics.flush()
        self.limits.taken += 1
        if done >= self.total:
            if self.save_last:
                self.save(done, state)
            return
        limit = self.limits.reached()
        if limit is not None or self._due(done):
            self.save(done, state)
        if limit is not None:
            self.checkpoints.wait()  # the process exits next: the (background) save first
            raise Stopped(
                f"{self.name}stopped at {limit} after step {done}, saved in "
                f"{self.checkpoints.directory} {self.limits.stamp()}"
            )

    def _due(self, done: int) -> bool:
        if self.save_every and done % self.save_every == 0:
            return True
        if self.save_minutes is None:
            return False
        return agreed(time.perf_counter() - self.last_save >= 60 * self.save_minutes)

    def remove_checkpoints(self) -> None:
        """Deletes the checkpoints, once what they hold is saved whole (the metrics stay)."""
        self.checkpoints.wait()
        self.checkpoints.remove()
        self.removed = True

    def close(self) -> None:
        """Waits for the last save; writes the metrics still waiting."""
        if not self.removed:
            self.checkpoints.wait()
            self.checkpoints.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> TrainLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
