"""BENCHMARKS.md and docs/gpu.md: every command in them runs as written on this tree, and they
read without a task list the reader does not have.

Checked statically, nothing runs: each command of a code block or a code span that invokes
`python -m jspec.<module>` or a `jspec-*` console script (mapped to its module through the
installed distribution's entry points) has its argv parsed by that module's own argparse parser,
captured without running the job (`ArgumentParser.parse_args` and its kin are patched to hand
the parser back). Every `--flag` must be an option of the parser (no abbreviations), the parser
must take the whole argv (nothing unknown, no error), positionals a job takes as overrides must be
dotted `a.b=c` overrides that its config accepts, and `--config NAME` must name a config in
`configs/`. Environment prefixes (`XLA_FLAGS=...`), wrappers (`sbatch`), `&`, `;`, redirections
and line continuations are allowed around a command. Stale module names (`jspec.launch`,
`bench_rollout`, `jspec/configs`) and scripts run by path (`python jspec/bench/x.py`) fail, as do
references to a task list (`item 2`, `#16`, `session`) and a BENCHMARKS.md over 400 lines.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import pathlib
import re
import shlex
from unittest import mock

import pytest
import tomllib

from jspec import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = {"BENCHMARKS.md": ROOT / "BENCHMARKS.md", "docs/gpu.md": ROOT / "docs" / "gpu.md"}
MAX_LINES = {"BENCHMARKS.md": 400}

# A reference to a task list, an issue or a working session: the reader has the repository only.
TASK_REFERENCES = re.compile(
    r"\bitems? \d|#\d+|\bsessions?\b|\bthe issue\b|\bcalls? \d|\bacceptance item", re.I
)
# Names the package had before its reorganisation (jobs in jspec.jobs, measurements in
# jspec.bench, configs at the top level), and scripts run by path instead of `python -m`.
STALE = re.compile(
    r"jspec[./]launch\b|jspec/configs\b|\blaunch/(?:bench_|train_|plot_|check_|demo)"
    r"|\bbench_(?:attention|rollout|decode_kernel|moe|async_rl|pipeline)\b(?!\.json)"
    r"|\bpython3? +\S*jspec/\S+\.py\b"
)
COMMAND = re.compile(r"(?:^|\s)(?:\S*python3?\s+-m\s+jspec\.|jspec-[a-z])")
PYTHON = re.compile(r"^(?:\S*/)?python3?$")
SEPARATORS = {";", "&", "&&", "|", "||", "(", ")", "do", "then", "else", "{", "}"}
REDIRECTS = {">", ">>", "<", ">&", "<&"}
OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*=")
PARSE_METHODS = {  # a patched method: the one that parses without exiting on what it does not know
    "parse_args": "parse_known_args",
    "parse_known_args": "parse_known_args",
    "parse_intermixed_args": "parse_known_intermixed_args",
    "parse_known_intermixed_args": "parse_known_intermixed_args",
}


def code_texts(text: str) -> list[str]:
    """The lines of fenced code blocks (continuations joined) and every inline code span (on
    one line: a span may wrap in the Markdown source)."""
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    out = []
    for block in fence.finditer(text):
        out += re.sub(r"\\\n", " ", block.group(1)).splitlines()
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", fence.sub("", text))]
    return out


def segments(code: str) -> list[list[str]]:
    """The simple commands of a shell line: split at ; & | && and the like, redirections out."""
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current, skip = [], [], False
    for token in lexer:
        if skip:
            skip = False
        elif token in SEPARATORS:
            out.append(current)
            current = []
        elif token in REDIRECTS or token.rstrip("0123456789") in REDIRECTS:
            skip = True
            if current and current[-1].isdigit():  # 2> file
                current.pop()
        else:
            current.append(token)
    return [s for s in out + [current] if s]


@functools.cache
def scripts() -> dict[str, str]:
    """Console script (pyproject.toml's [project.scripts], so an uninstalled checkout reads them
    too) -> the module whose `main` it runs (a `jspec.jobs.cli.entry(module)` closure names it;
    a plain function's own module otherwise)."""
    out = {}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in declared.items():
        module_name, attribute = target.split(":")
        entry = getattr(importlib.import_module(module_name), attribute)
        module = inspect.getclosurevars(entry).nonlocals.get("module")
        out[name] = module if isinstance(module, str) else module_name
    return out


def commands(text: str) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """(the command as written, module, argv) of every jspec command in `text`'s code, and the
    problems of the ones that could not be read."""
    found, problems = [], []
    for code in code_texts(text):
        if not COMMAND.search(code):
            continue
        try:
            parts = segments(code)
        except ValueError as error:
            problems.append(f"`{code}`: not a shell command ({error})")
            continue
        for tokens in parts:
            for i, token in enumerate(tokens):
                if PYTHON.match(token) and tokens[i + 1 : i + 2] == ["-m"]:
                    if len(tokens) > i + 2 and tokens[i + 2].startswith("jspec."):
                        found.append((code, tokens[i + 2], tokens[i + 3 :]))
                    break
                if token.startswith("jspec-"):
                    if token not in scripts():
                        problems.append(f"`{code}`: {token} is not a console script of jspec")
                    else:
                        found.append((code, scripts()[token], tokens[i + 1 :]))
                    break
    return found, problems


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, method: str):
        super().__init__(method)
        self.parser, self.method = parser, method


@functools.cache
def parser_of(module_name: str) -> tuple[argparse.ArgumentParser, str]:
    """The argparse parser `module_name` builds for its command line, and the name of the method
    that parses like the one the module calls without exiting on unknown arguments. The module's
    `parse_args` (or its `main`, where the parser is built there) runs with every parsing method
    of ArgumentParser patched to raise with the parser: nothing past the parser runs."""
    module = importlib.import_module(module_name)
    build = getattr(module, "parse_args", None) or getattr(module, "main", None)
    if build is None:
        raise LookupError(f"{module_name} has neither parse_args nor main")

    def capture(method):
        def stop(self, *args, **kwargs):
            raise _Captured(self, PARSE_METHODS[method])

        return stop

    with contextlib.ExitStack() as stack:
        for method in PARSE_METHODS:
            stack.enter_context(mock.patch.object(argparse.ArgumentParser, method, capture(method)))
        try:
            build([])
        except _Captured as captured:
            return captured.parser, captured.method
    raise LookupError(f"{module_name}: {build.__name__}([]) returned without parsing arguments")


def config_names() -> set[str]:
    return {p.stem for p in config_lib.CONFIG_DIR.glob("*.yaml")}


def check_command(module_name: str, argv: list[str]) -> list[str]:
    """What keeps `python -m module_name argv` from running as written (empty: nothing)."""
    try:
        found = importlib.util.find_spec(module_name)
    except ModuleNotFoundError:  # its package does not exist either
        found = None
    if found is None:
        return [f"no module {module_name}"]
    try:
        parser, method = parser_of(module_name)
    except LookupError as error:
        return [str(error)]
    except Exception as error:  # the module does not import: the command cannot run either
        return [f"{module_name} does not import: {type(error).__name__}: {error}"]
    problems = []
    remainder = next((a for a in parser._actions if a.nargs == argparse.REMAINDER), None)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, unknown = getattr(parser, method)(argv)
    except SystemExit:
        said = stderr.getvalue().strip().splitlines() or ["(nothing said)"]
        return [f"{module_name} refuses its arguments: {said[-1]}"]
    if unknown:
        problems.append(f"{module_name} does not take {' '.join(unknown)}")
    inner = list(getattr(args, remainder.dest) or []) if remainder else []
    own = argv[: len(argv) - len(inner)]
    for token in own:
        if re.match(r"^--?[A-Za-z]", token):
            flag = token.split("=", 1)[0]
            if flag not in parser._option_string_actions:
                problems.append(f"{module_name} has no option {flag}")
    named = any(t == "--config" or t.startswith("--config=") for t in own)
    if named and "--config" in parser._option_string_actions:
        name = args.config
        path = ROOT / name
        if name not in config_names() and not (path.suffix in (".yaml", ".yml") and path.is_file()):
            problems.append(f"--config {name} is not a config in configs/")
    overrides = [
        *(getattr(args, "overrides", None) or []),
        *(getattr(args, "set", None) or []),
    ]
    bad = [o for o in overrides if not OVERRIDE.match(o)]
    if bad:
        problems.append(f"{module_name}: positionals {bad} are not dotted overrides a.b=c")
    elif isinstance(getattr(args, "config", None), str) and not any("$" in o for o in overrides):
        try:
            config_lib.load(args.config, overrides)
        except (config_lib.ConfigError, TypeError, ValueError) as error:
            problems.append(f"{module_name} --config {args.config} {' '.join(overrides)}: {error}")
    if remainder and hasattr(args, "job"):  # the launcher: its job and the job's own arguments
        job = args.job if "." in args.job else f"jspec.jobs.{args.job}"
        problems += check_command(job, inner)
    return problems


def problems_of(path: pathlib.Path, name: str) -> list[str]:
    """Everything wrong with the document at `path` (shown as `name`)."""
    text = path.read_text()
    problems = []
    lines = text.count("\n") + (not text.endswith("\n"))
    if name in MAX_LINES and lines > MAX_LINES[name]:
        problems.append(f"{name} has {lines} lines (at most {MAX_LINES[name]})")
    for number, line in enumerate(text.splitlines(), 1):
        for match in TASK_REFERENCES.finditer(line):
            problems.append(f"{name}:{number}: a task-list reference {match.group(0)!r}")
        for match in STALE.finditer(line):
            problems.append(
                f"{name}:{number}: a stale name or a script run by path {match.group(0)!r}"
            )
    found, unreadable = commands(text)
    problems += [f"{name}: {p}" for p in unreadable]
    for code, module, argv in found:
        problems += [f"{name}: `{code}`: {p}" for p in check_command(module, argv)]
    return problems


@pytest.mark.parametrize("name", sorted(DOCS))
def test_doc_commands_run_as_written(name):
    problems = problems_of(DOCS[name], name)
    assert not problems, "\n".join(problems)


def test_benchmarks_doc_has_commands():
    """The check above would pass an empty file: BENCHMARKS.md's claims come with commands."""
    found, _ = commands(DOCS["BENCHMARKS.md"].read_text())
    assert len(found) >= 10
    assert {m for _, m, _ in found} >= {"jspec.bench.rollout", "jspec.jobs.train_code_lm"}


def test_the_check_catches_what_it_should(tmp_path):
    """A document with each kind of fault fails with each fault named; a good one passes."""
    good = (
        "Run `XLA_FLAGS=--x=1 python -m jspec.bench.rollout --config tiny --batches 1 2 &` and\n"
        "```\njspec-train-rl --config demo --quiet \\\n  rl.steps=2 --draft-mode frozen\n```\n"
        "then `jspec-launch train_rl --config demo rl.steps=1`.\n"
    )
    path = tmp_path / "good.md"
    path.write_text(good)
    assert problems_of(path, "BENCHMARKS.md") == []
    bad = (
        "As item 2 asks (#16), this session ran `python -m jspec.launch.bench_rollout`,\n"
        "`python -m jspec.bench.rollout --batch 1`, `python -m jspec.bench.rollout --iter 2`,\n"
        "`jspec-bench-rollout --config nope`, `jspec-nope`, `jspec-train-rl rl.nope=1`,\n"
        "`python3 jspec/bench/moe.py`, `python -m jspec.bench.moe stray`.\n"
    )
    path.write_text(bad + "x\n" * 400)
    problems = "\n".join(problems_of(path, "BENCHMARKS.md"))
    for expected in (
        "'item 2'",
        "'#16'",
        "'session'",
        "'jspec.launch'",
        "no module jspec.launch.bench_rollout",
        "has no option --batch",
        "has no option --iter",
        "--config nope is not a config",
        "jspec-nope is not a console script",
        "rl.nope=1",
        "jspec/bench/moe.py",
        "does not take stray",
        "lines (at most 400)",
    ):
        assert expected in problems, expected
