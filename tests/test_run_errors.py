"""A run a person can trust: checkpoints that heal after corruption, a resume that names what
changed, a time limit that saves and exits 75, and bad input answered in a line or two with exit
status 2 (the table of docs/errors.md, run row by row)."""

import asyncio
import gc
import logging
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import types

import pytest
from helpers import LOOP

from jspec.config import ConfigError
from jspec.jobs import cli, train_rl, trainer
from jspec.rl import checkpoints

ERRORS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"
QUIET = ["--quiet"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, compilation_cache) -> tuple[pathlib.Path, list[str]]:
    """A finished run of 3 RL steps, a checkpoint after each (the last 3 kept: 1, 2, 3), and the
    arguments that made it."""
    args = [*LOOP, "rl.steps=3", "rl.sft_steps=1", "--compilation-cache", compilation_cache]
    run = tmp_path_factory.mktemp("finished")
    train_rl.main([*args, *QUIET, "--run-dir", str(run)])
    return run, args


def steps(run: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def truncate_arrays(step: pathlib.Path) -> None:
    for f in step.glob("state/**/d/*"):
        f.write_bytes(f.read_bytes()[:10])


def garble_metadata(step: pathlib.Path) -> None:
    (step / "state" / "_METADATA").write_text("{not json")


def remove_state(step: pathlib.Path) -> None:
    shutil.rmtree(step / "state")


def terminal(*args: str) -> str:
    """What `python -m jspec.jobs.train_rl ARGS` prints (its own process: what a person sees,
    stray reports of background threads included); it must succeed."""
    command = [sys.executable, "-m", "jspec.jobs.train_rl", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize("corrupt", [truncate_arrays, garble_metadata, remove_state])
def test_a_corrupt_checkpoint_is_set_aside_and_saved_anew(finished, tmp_path, corrupt):
    """The newest checkpoint corrupted: the resume says so in at most 5 lines, resumes from the one
    before, saves the bad step again; the next resume needs no fallback; retention never dropped
    the newest checkpoint that restores."""
    source, args = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    corrupt(run / "checkpoints" / "3")
    lines = terminal(*args, "rl.steps=4", *QUIET, "--run-dir", str(run)).strip().splitlines()
    assert len(lines) <= 5, lines
    assert re.match(r"checkpoint step 3 does not restore \(\w+", lines[0]), lines
    assert any(line.startswith("resuming from step 2 in ") for line in lines), lines
    assert steps(run) == [2, 3, 4] and (run / "corrupt" / "3").is_dir()

    err = terminal(*args, "rl.steps=4", *QUIET, "--run-dir", str(run))
    assert "does not restore" not in err and "resuming from step 4" in err, err
    assert "already complete at step 4" in err, err
    assert steps(run) == [2, 3, 4]


def test_a_resume_names_what_changed(finished, tmp_path, capfd):
    """Changes that keep the run exact are accepted with a line; others only when asked for."""
    source, args = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    capfd.readouterr()
    train_rl.main([*args, "rl.steps=3", "rl.save_every=2", *QUIET, "--run-dir", str(run)])
    assert "resuming with a changed config: rl.save_every: 1 -> 2" in capfd.readouterr().err
    status = cli.run(train_rl.main, [*args, "rl.learning_rate=1e-3", "--run-dir", str(run)])
    err = capfd.readouterr().err
    assert status == 2 and "rl.learning_rate: 0.0002 -> 0.001" in err, err
    status = cli.run(
        train_rl.main,
        [*args, "rl.learning_rate=1e-3", *QUIET, "--allow-config-change", "--run-dir", str(run)],
    )
    assert status == 0
    assert "resuming with a changed config: rl.learning_rate: 0.0002 -> 0.001" in (
        capfd.readouterr().err
    )


def test_a_time_limit_saves_the_step_and_exits_75(finished, tmp_path, capfd):
    """--stop-after MINUTES, as in train_code_lm: past the limit (0: after the first step) the
    step is saved, a line says so, and the status is 75; the same command resumes."""
    source, args = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    capfd.readouterr()
    argv = [*args, "rl.steps=5", *QUIET, "--stop-after", "0", "--run-dir", str(run)]
    with pytest.raises(SystemExit) as stop:
        cli.run(train_rl.main, argv)
    assert stop.value.code == trainer.EXIT_RESUME
    err = capfd.readouterr().err
    assert "stopped at the time limit after step 4, saved in " in err, err
    assert err.rstrip().endswith("; run the same command to resume"), err
    assert steps(run) == [2, 3, 4]


def test_a_metrics_line_cut_short_is_written_again_not_a_stop(tmp_path):
    """A process killed in the middle of writing metrics.jsonl leaves a partial last line: the
    resumed run reads the whole ones and writes on from the step it resumes at."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.5}\n{"step": 1, "lo')
    assert trainer.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "loss": 1.5}]
    metrics = trainer.Metrics(tmp_path)
    metrics.write(1, {"loss": 1.25})
    metrics.flush()
    rows = trainer.read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 1.25}]


def test_fields_added_since_a_checkpoint_was_written_are_named_not_refused(tmp_path):
    """A config field the checkpoint's config lacks (added to jspec after it was saved) is
    accepted with a line; a field that exists and differs is still refused."""
    from jspec.rl.checkpoints import Checkpoints

    ckpts = Checkpoints(tmp_path, {"model": {"width": 2, "new": 1}, "seed": 0})
    assert ckpts.check_config({"model": {"width": 2}, "seed": 0}, 3) == "model.new: (absent) -> 1"
    with pytest.raises(ConfigError, match="another model or draft"):
        ckpts.check_config({"model": {"width": 3}, "seed": 0}, 3)
    ckpts.close()


def table_rows() -> list[tuple[str, str, str]]:
    """(bad input, command, message) of each row of docs/errors.md's table."""
    rows = []
    for line in ERRORS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("jspec-train-rl"):
            rows.append(tuple(cells))
    return rows


@pytest.fixture
def placeholders(finished, tmp_path) -> dict[str, str]:
    """What the table's RUN, FILE, READONLY and BADJSON stand for."""
    (tmp_path / "FILE").write_text("a file")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere it may chmod; /sys refuses even root
        readonly = pathlib.Path("/sys/jspec-run")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{not json")
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    return {
        "RUN": str(run),
        "FILE": str(tmp_path / "FILE"),
        "READONLY": str(readonly),
        "BADJSON": str(tmp_path / "draft"),
    }


def substitute(text: str, placeholders: dict[str, str]) -> str:
    return re.sub("|".join(placeholders), lambda m: placeholders[m.group()], text)


@pytest.mark.parametrize("bad, command, message", table_rows(), ids=lambda x: x[:24])
def test_bad_input_gets_its_message_and_status_2(
    finished, placeholders, capfd, bad, command, message
):
    """Each row of docs/errors.md, run with the test's tiny model (LOOP) ahead of its own
    arguments: its message, exit status 2, no traceback."""
    argv = shlex.split(substitute(command, placeholders))[1:]
    capfd.readouterr()
    status = cli.run(train_rl.main, [*finished[1], *argv])
    err = capfd.readouterr().err
    assert status == 2, (bad, err)
    assert err.startswith(substitute(message, placeholders)), (bad, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, (bad, err)


def test_the_table_covers_the_bad_inputs_tried():
    assert len(table_rows()) == 11


def test_reports_of_a_failed_read_go_to_the_log(tmp_path, monkeypatch, capsys, caplog):
    """What a failed read leaves behind, reported whenever the collector or a late callback runs:
    asyncio's 'Future exception was never retrieved' and the unraisable 'Event loop is closed'.
    Both go to the run's log, not the terminal; other reports still reach the terminal."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    asyncio_logger = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_logger, "filters", list(asyncio_logger.filters))
    log = tmp_path / "checkpoints.log"
    checkpoints._log_stray_callbacks(log)
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(ValueError('OUT_OF_RANGE: Error opening "zarr" driver'))
    loop.close()
    del future
    gc.collect()
    sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    asyncio_logger.error("another report")
    shown = capsys.readouterr().err + caplog.text
    assert "never retrieved" not in shown and "loop is closed" not in shown
    assert "another report" in caplog.text
    written = log.read_text()
    assert "Future exception was never retrieved" in written and "OUT_OF_RANGE" in written
    assert "Event loop is closed" in written
