"""Running untrusted Python (a model's output) in a separate process, bounded in time and memory.

A code task's reward executes what the policy wrote. A program that hangs, crashes, exhausts memory
or prints without end must score 0 and never stop or stall a training run, so each program runs in
a process of its own and whatever happens to it comes back as an `Outcome`, never as an exception.

What it gives, on Linux:
- the isolated interpreter `sys.executable -I` (no user site, no PYTHON* variables, no working
  directory on sys.path), stdin closed, an environment of PATH and LANG alone;
- a fresh temporary working directory (the program is `main.py` there), deleted afterwards;
- limits on address space, CPU seconds and file size (the output included), and no core dumps,
  set by the child's interpreter before the program starts;
- a wall-clock timeout that kills the program's whole process group;
- where this machine lets `unshare` make namespaces without privileges (`namespaces()`): new user,
  network and pid namespaces, so there is no network interface but loopback (and that one down),
  every process the program starts dies with it, and it may run at most `PROCESSES` processes
  (unless the caller is root, whom the kernel does not hold to RLIMIT_NPROC);
- in every case, before the program runs, a prelude that makes `socket.socket`,
  `socket.create_connection` and `socket.getaddrinfo` raise OSError.

What it does not give: it is not a security boundary against a determined adversary. The program
runs as the caller's user (root of its own user namespace, mapped to that user): it can read what
the caller can read and write (a few MB at a time) where the caller can write, there is no system
call filter, the prelude is undone by a program that means to (`_socket`), and without the
namespaces the network is reachable that way and a process that leaves its session outlives the
kill. It keeps a model's mistakes from hurting the run; code from an adversary belongs in a
container or a virtual machine of its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, NamedTuple

OUTPUT_BYTES = 64 * 1024  # the tail of stdout and of stderr that an Outcome keeps
FILE_BYTES = 8 * 1024 * 1024  # the largest file a program may write, its stdout and stderr too
PROCESSES = 32  # processes and threads of a program, in its own namespaces
ENVIRONMENT = {"PATH": os.defpath, "LANG": "C.UTF-8"}

NO_NETWORK = """\
import socket


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")


class _NoSocket(socket.socket):
    __init__ = _no_network


socket.socket = _NoSocket
socket.create_connection = socket.getaddrinfo = _no_network
"""
RUN_MAIN = "import runpy\nrunpy.run_path('main.py', run_name='__main__')\n"
# RLIMIT_NPROC counts every process of the user, but in the program's own user namespace only the
# program's: so it is set there (after `unshare` made the namespace), never outside one.
FEW_PROCESSES = f"import resource\nresource.setrlimit(resource.RLIMIT_NPROC, ({PROCESSES},) * 2)\n"


class Outcome(NamedTuple):
    stdout: str  # the last OUTPUT_BYTES of each
    stderr: str
    returncode: int | None  # None when it timed out or could not start; -N when signal N ended it
    timed_out: bool


@functools.cache
def namespaces() -> tuple[str, ...]:
    """The `unshare` command that runs a program in new user, network and pid namespaces, or ()
    where this machine does not allow it (no util-linux, user namespaces off, a seccomp filter)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    command = (unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
    try:
        probe = subprocess.run(
            [*command, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return command if probe.returncode == 0 else ()


def _limits(timeout_s: float, memory_mb: int) -> str:
    """The prelude that sets the limits, each no higher than the caller's own hard limit. The
    child's interpreter sets them before the program runs: no `preexec_fn`, as Python code
    between fork and exec is unsafe in a threaded process such as JAX's."""
    wanted = {
        "RLIMIT_AS": memory_mb * 2**20,
        "RLIMIT_CPU": math.ceil(timeout_s) + 1,
        "RLIMIT_FSIZE": FILE_BYTES,
        "RLIMIT_CORE": 0,
    }
    lines = ["import resource"]
    for kind, value in wanted.items():
        hard = resource.getrlimit(getattr(resource, kind))[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        lines.append(f"resource.setrlimit(resource.{kind}, ({value}, {value}))")
    return "\n".join(lines) + "\n"


def _tail(file: IO[bytes]) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - OUTPUT_BYTES))
    return file.read().decode("utf-8", errors="replace")


def run_python(source: str, *, timeout_s: float = 2.0, memory_mb: int = 512) -> Outcome:
    """Runs `source` as a program in a fresh process and directory, at most `timeout_s` seconds
    of wall-clock time and `memory_mb` MiB of address space."""
    prefix = namespaces()
    program = _limits(timeout_s, memory_mb) + NO_NETWORK + (FEW_PROCESSES if prefix else "")
    program += RUN_MAIN
    with (
        tempfile.TemporaryDirectory(prefix="jspec-sandbox-", ignore_cleanup_errors=True) as cwd,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
        pathlib.Path(cwd, "main.py").write_text(source, encoding="utf-8", errors="replace")
        try:
            process = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-c", program],
                cwd=cwd,
                env=ENVIRONMENT,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as error:
            return Outcome("", f"the sandbox could not start the program: {error}", None, False)
        try:
            process.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError):  # what it left running goes with it
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return Outcome(
            _tail(stdout), _tail(stderr), None if timed_out else process.returncode, timed_out
        )


def run_many(
    sources: Sequence[str],
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 512,
    workers: int | None = None,
) -> list[Outcome]:
    """`run_python` of each source, `workers` at a time (default: two per core, at most 16), in
    the order of `sources`."""
    workers = workers or min(16, 2 * len(os.sched_getaffinity(0)))
    run = functools.partial(run_python, timeout_s=timeout_s, memory_mb=memory_mb)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, sources))
