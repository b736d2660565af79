"""Orbax checkpoints of a training state (any pytree: `jspec.rl.state.TrainState`, a stage's
parameters and optimizer state), with the run's config saved beside each as JSON.

Resuming (`Checkpoints.restore_latest`) reads the newest step whose state restores, before
anything is compiled. A config changed in a way that breaks the resume is refused (`SHAPED_BY`:
the state's shapes follow it; anything outside `SAFE_TO_CHANGE` would make the run differ from the
uninterrupted one, unless the changes are allowed), and a corrupt checkpoint is set aside, to
`corrupt/` beside the checkpoints (the step is then saved anew), and the one before it used. The
reader's reports of a failed read (thousands of lines from orbax and TensorStore) go to
`checkpoints.log` beside the checkpoints, not the terminal.

Both jobs save through this class: `jspec.jobs.train_rl` (the RL run) and
`jspec.jobs.train_code_lm` (each stage), by way of `jspec.jobs.trainer.TrainLoop`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jspec.config import ConfigError

State = TypeVar("State")

# Config fields an RL checkpoint's state is shaped by: a resume that changes them cannot restore.
SHAPED_BY = ("model", "draft_mode", "rollout.draft", "pipeline")
# Config fields an RL resume may change and still continue as the uninterrupted run would have.
SAFE_TO_CHANGE = (
    "name",
    "rl.steps",
    "rl.save_every",
    "rl.samples_every",
    "rl.keep_checkpoints",
)


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (saved value, current value)} of the fields that differ."""
    saved, current = _flat(saved), _flat(current)
    keys = sorted(set(saved) | set(current))
    return {k: (saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)}


def _under(field: str, sections: tuple[str, ...]) -> bool:
    return any(field == s or field.startswith(s + ".") for s in sections)


@contextlib.contextmanager
def _output_to(log: pathlib.Path):
    """Everything written to the process's stderr (orbax's and TensorStore's reports of a failed
    read: thousands of lines) goes to the end of `log` instead."""
    _log_stray_callbacks(log)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("a") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


class Checkpoints:
    """Async orbax checkpoints of a state pytree, with the run's config (a JSON dict) beside each.

    Resuming (`restore_latest`) reads the newest checkpoint that restores. One that does not
    (truncated, garbled, half deleted) is moved out of the way, to `corrupt/` beside the
    checkpoints, with one line saying why (the reader's full report goes to `checkpoints.log`):
    the run then saves that step anew, and retention (the newest `keep`) only ever counts
    checkpoints that restore. A checkpoint written with a different config is refused when the
    state's shapes follow the change (`shaped_by`), or when the run would no longer continue as
    the uninterrupted one would have, unless `allow_changes`; changes in `safe_to_change` are
    accepted. Each accepted change is logged. The defaults are an RL run's fields."""

    def __init__(
        self,
        directory: str | pathlib.Path,
        config: dict,
        keep: int = 3,
        *,
        allow_changes: bool = False,
        log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
        shaped_by: tuple[str, ...] = SHAPED_BY,
        safe_to_change: tuple[str, ...] = SAFE_TO_CHANGE,
    ):
        self.directory = pathlib.Path(directory).resolve()
        self.config = json.loads(json.dumps(config))  # JSON types, as it will be read back
        self.keep, self.allow_changes, self.log = keep, allow_changes, log
        self.shaped_by, self.safe_to_change = shaped_by, safe_to_change
        self.log_file = self.directory.parent / "checkpoints.log"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "config")
        )

    def steps(self) -> list[int]:
        """The steps saved (committed), oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state) -> None:
        """Starts an async save (returns once the arrays are copied off the devices)."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config)
            ),
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def remove(self) -> None:
        """Closes the manager and deletes the checkpoints (once what they held is saved whole)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def check_config(self, saved: dict, step: int) -> str:
        """Raises ConfigError when checkpoint `step` (config `saved`) cannot or should not be
        resumed with this run's config; the changes it accepts, described ('' for none)."""
        changes = changed_fields(saved, self.config)
        # Fields the checkpoint's config lacks were added to jspec after it was written: named,
        # never refused.
        added = set(_flat(self.config)) - set(_flat(saved))
        where = f"checkpoint step {step} in {self.directory}"
        before = lambda k: "(absent)" if k in added else repr(changes[k][0])
        describe = lambda fields: ", ".join(
            f"{k}: {before(k)} -> {changes[k][1]!r}" for k in fields
        )
        shaped = [k for k in changes if _under(k, self.shaped_by) and k not in added]
        if shaped:
            raise ConfigError(
                f"{where} was written with another model or draft ({describe(shaped)}); resume "
                "with the config it was written with, or start a new run directory."
            )
        exact = [k for k in changes if not _under(k, self.safe_to_change) and k not in added]
        if exact and not self.allow_changes:
            raise ConfigError(
                f"{where} was written with {describe(exact)}; with a changed value the run "
                "would not continue as it was. Resume with the saved values, pass "
                "--allow-config-change to continue with the new ones, or start a new run "
                "directory."
            )
        return describe(sorted(changes))

    def check_resume(self) -> None:
        """`check_config` against the newest checkpoint whose config reads, so that a resume the
        config refuses fails before anything is built (`restore_latest` checks again)."""
        for step in reversed(self.steps()):
            try:
                saved = self._restore_config(step)
            except Exception:  # noqa: BLE001 - restore_latest sets it aside
                continue
            self.check_config(saved, step)
            return

    def restore_latest(self, template: State) -> tuple[State, int] | None:
        """(state, step) of the newest checkpoint that restores (None: there is none), placed and
        structured like `template`. A checkpoint written with another config is an error; one
        that fails to read is moved aside and the one before it tried."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        for step in reversed(self.steps()):
            try:
                saved = self._restore_config(step)
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is set aside
                self._set_aside(step, error)
                continue
            changes = self.check_config(saved, step)
            try:
                with _output_to(self.log_file):
                    restored = self.manager.restore(
                        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
                    )
            except Exception as error:  # noqa: BLE001
                self._set_aside(step, error)
                continue
            self.log(f"resuming from step {step} in {self.directory}")
            if changes:
                self.log(f"resuming with a changed config: {changes}")
            leaves = jax.tree.leaves(restored.state)
            return jax.tree.unflatten(jax.tree.structure(template), leaves), step
        return None

    def _restore_config(self, step: int) -> dict:
        with _output_to(self.log_file):
            args = ocp.args.Composite(config=ocp.args.JsonRestore())
            return self.manager.restore(step, args=args).config

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves unreadable checkpoint `step` to `corrupt/` (process 0, once every process has
        failed to read it), so that the step can be saved again."""
        aside = self.directory.parent / "corrupt" / f"{step}"
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
        self.log(
            f"checkpoint step {step} does not restore ({reason}); moved to {aside}, details in "
            f"{self.log_file}"
        )
        _barrier(f"jspec checkpoint {step} unreadable")
        if jax.process_index() == 0:
            aside.parent.mkdir(parents=True, exist_ok=True)
            if aside.exists():
                shutil.rmtree(aside)
            shutil.move(str(self.directory / f"{step}"), aside)
        _barrier(f"jspec checkpoint {step} set aside")
        self.manager.reload()


def _log_stray_callbacks(log: pathlib.Path) -> None:
    """After a failed read, TensorStore's callbacks still land, one per array, on the read's event
    loop, closed by then: Python reports each as an unraisable 'Event loop is closed' (thousands
    of tracebacks in the terminal), and asyncio each failed read whose future is collected unread
    ('Future exception was never retrieved', whenever the collector runs). Those go to `log`; any
    other unraisable error or asyncio report as before."""
    default = sys.unraisablehook
    if getattr(default, "jspec_log", None) == log:
        return
    asyncio_logger = logging.getLogger("asyncio")
    for old in [f for f in asyncio_logger.filters if isinstance(f, _UnreadFailures)]:
        asyncio_logger.removeFilter(old)
    asyncio_logger.addFilter(_UnreadFailures(log))

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(
            unraisable.exc_value
        ):
            with log.open("a") as f:
                traceback.print_exception(unraisable.exc_value, file=f)
        else:
            default(unraisable)

    hook.jspec_log = log
    sys.unraisablehook = hook


class _UnreadFailures(logging.Filter):
    """asyncio's reports of a future's exception never retrieved, written to `log` instead."""

    def __init__(self, log: pathlib.Path):
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in record.getMessage():
            return True
        with self.log.open("a") as f:
            f.write(logging.Formatter().format(record) + "\n")
        return False


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
