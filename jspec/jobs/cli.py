"""How a job meets the shell: exit status 0 on success, 2 with one or two lines on bad input.

Every console script and `python -m jspec.jobs.<job>` runs its job's `main(argv)` through `run`.
A job's `main` may return a value (a run directory, a plan, a table) for Python callers; the shell
sees 0. An input a person can fix (a `ConfigError`: a config value, a missing or corrupt
checkpoint, a run directory that cannot be written) prints `error: <message>` and exits 2, no
traceback; `--debug` (anywhere in the arguments) or `JSPEC_DEBUG=1` raises it with its traceback
instead. Anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Sequence

from jspec.config import ConfigError

USAGE_ERROR = 2  # as argparse exits on a bad argument


def run(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> int:
    """The exit status of `main(argv)` (argv: the command line's arguments when None)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("JSPEC_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        main(argv)
    except ConfigError as error:
        if debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        print("(--debug or JSPEC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    return 0


_KIND_NAMES = {int: "an integer", float: "a number"}


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse `type`: a finite number of `kind` (int or float) no smaller than `low`, so that
    `--steps -1` or `--learning-rate nan` is refused with the flag's name before anything runs."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_KIND_NAMES[kind]}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number >= {low}")
        return value

    return parse


def positive(text: str) -> float:
    """An argparse `type`: a finite float above 0 (a learning rate, a time, a size in GB)."""
    value = at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def run_directory(path: pathlib.Path) -> pathlib.Path:
    """`path`, created if need be; a ConfigError when it is not a directory this process can
    write (before anything is built, and before orbax reports it from deep inside a save)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(
            f"--run-dir {path}: it or a folder above it is a file; pass a directory (it is "
            "created if missing)."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"--run-dir {path} cannot be written ({error.strerror}); pass a directory you can "
            "write, e.g. --run-dir runs/NAME."
        ) from None
    return path


def entry(module: str) -> Callable[[], int]:
    """A console script's entry point: `module`'s main under `run`."""
    return lambda: run(importlib.import_module(module).main)


# The jobs' console scripts (pyproject.toml's [project.scripts]; the measurements' are in
# jspec.bench.scripts).
train_rl = entry("jspec.jobs.train_rl")
demo = entry("jspec.jobs.demo")
plan = entry("jspec.jobs.plan")
launch = entry("jspec.jobs.distributed")
plot_runs = entry("jspec.jobs.plot_runs")
train_code_lm = entry("jspec.jobs.train_code_lm")


def messengers(quiet: bool):
    """(say, log): say prints on process 0 (warnings, the resume); log the same unless `quiet`
    (progress)."""
    from tqdm import tqdm

    from jspec import hosts

    say = (lambda msg: tqdm.write(msg, file=sys.stderr)) if hosts.is_main() else (lambda _: None)
    return say, (lambda _: None) if quiet else say


def add_compilation_cache_argument(parser) -> None:
    """`--compilation-cache DIR`: XLA's persistent cache, runs/.jax_cache by default, which the
    jobs and benchmarks share, so that a program compiled once (a resumed run's, a benchmark's
    plain loop timed again beside another draft) is not compiled again."""
    parser.add_argument(
        "--compilation-cache",
        default=str(pathlib.Path("runs") / ".jax_cache"),
        help="persistent XLA compilation cache: a program compiled before is read back ('' off)",
    )


def use_compilation_cache(directory: str | None) -> None:
    """Compiled programs kept in `directory` (none: jax's default) for the next run."""
    if directory:
        import jax

        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
