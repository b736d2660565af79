"""Running untrusted Python (a model's output) in a separate process, bounded in time and memory.

A code task's reward executes what the policy wrote. A program that hangs, crashes, exhausts memory
or prints without end must score 0 and never stop or stall a training run, so each program runs in
a process of its own and whatever happens to it comes back as an `Outcome`, never as an exception.

Programs are forked from zygotes, as a fresh interpreter costs ~35 ms of CPU (Python's start-up: a
step's 128 programs took as long as the train step) and a fork ~2 ms, mostly the page faults of
the memory both processes share until either writes it. A zygote is an interpreter started once
(`sys.executable -I`, the minimal environment, the namespaces below), one per worker thread that
needed one, kept until `close()` or exit. It reads a request (a JSON line) on its stdin, makes the
program's files, forks a child that runs it, waits, kills what it left, removes the files and
answers on its stdout: the caller, whose threads share one interpreter lock, does little.

What it gives, on Linux 5.3 or later (pidfd):
- a process of its own per program, forked from a zygote that imported a few standard modules:
  what the program changes in its interpreter (modules, os.environ, socket.socket) ends with it;
  the isolated interpreter (`-I`: no user site, no PYTHON* variables, no working directory on
  sys.path), stdin /dev/null, an environment of PATH and LANG alone; stdout and stderr go to files
  in memory, and the child holds no other descriptor: it reads no request, writes no answer;
- a fresh temporary working directory (the program is `main.py` there), deleted afterwards;
- limits on address space, CPU seconds and file size (the output included), and no core dumps,
  set in the child before the program runs (the zygote keeps the caller's limits);
- a wall-clock timeout; at it, and after every program, the processes it started are killed;
- where this machine lets `unshare` make namespaces without privileges (`namespaces()`): new user,
  network and pid namespaces, so there is no network interface but loopback (and that one down),
  the zygote is the init of its pid namespace and after each program kills every other process
  there (one that left the program's session too), and the program may run at most `PROCESSES`
  processes (unless the caller is root, whom the kernel does not hold to RLIMIT_NPROC);
- in every case a prelude, run once in the zygote and so in force in every child, that makes
  `socket.socket`, `socket.create_connection` and `socket.getaddrinfo` raise OSError;
- a zygote that dies (killed from outside, or by its program) or does not answer in time is
  replaced, and the program runs once more on a new one; a second failure is an Outcome too.

What it does not give: it is not a security boundary against a determined adversary. The program
runs as the caller's user (root of its own user namespace, mapped to that user): it can read what
the caller can read and write (a few MB at a time) where the caller can write, there is no system
call filter, the prelude is undone by a program that means to (`_socket`), and without the
namespaces the network is reachable that way and a process that leaves its session outlives the
kill. A child starts with a copy of its zygote's memory (earlier requests may be found there), its
modules and its str hash seed (the same for all of its programs), and a program that means to can
reach its zygote (signals, /proc) and garble its own answer, no other: an answer names its request.
It keeps a model's mistakes from hurting the run; code from an adversary belongs in a container or
a virtual machine of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

OUTPUT_BYTES = 64 * 1024  # the tail of stdout and of stderr that an Outcome keeps
FILE_BYTES = 8 * 1024 * 1024  # the largest file a program may write, its stdout and stderr too
PROCESSES = 32  # processes and threads of a program, in its own namespaces
ENVIRONMENT = {"PATH": os.defpath, "LANG": "C.UTF-8"}
GRACE_S = 30.0  # how much longer than a program's timeout its zygote may take to answer

NO_NETWORK = """\
import socket


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")


class _NoSocket(socket.socket):
    __init__ = _no_network


socket.socket = _NoSocket
socket.create_connection = socket.getaddrinfo = _no_network
"""

# The zygote's program: a loop of requests, one forked child each. Its stdin and stdout become
# /dev/null (the pipes move to other descriptors, which a child closes), so nothing it or a child
# prints reaches the answers.
ZYGOTE = (
    NO_NETWORK
    + r'''
import atexit, gc, json, os, resource, select, signal, sys, tempfile

ALONE = os.getpid() == 1  # the init of its own pid namespace: kill(-1) reaches its programs alone


def run_main():
    """Runs main.py as python would, in a fresh __main__: its exit status, 0, SystemExit's
    code, or 1 for an uncaught exception, whose traceback (less this frame) goes to stderr."""
    main = type(sys)("__main__")
    main.__file__ = sys.argv[0] = "main.py"
    sys.modules["__main__"] = main
    try:
        with open("main.py", "rb") as file:
            code = compile(file.read(), "main.py", "exec")
        exec(code, vars(main))
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return (stop.code or 0) & 255
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:
        error.__traceback__ = error.__traceback__.tb_next
        sys.excepthook(type(error), error, error.__traceback__)
        return 1
    return 0


def child(request, cwd, out, err):
    """Runs the program in the forked child and ends it as python would, never returning."""
    exit, code = os._exit, 1  # taken before the program could replace os._exit
    try:
        gc.enable()
        os.setsid()
        os.chdir(cwd)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the pipes, the zygote's files
        for kind, value in request["limits"]:
            resource.setrlimit(kind, (value, value))
        atexit._clear()  # the zygote's: only the program's run at its end
        code = run_main()
        if "threading" in sys.modules:  # python's end: wait for threads, atexit, flush
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        exit(code)


def run(request, cwd, out, err):
    """Forks the program, waits for it at most its timeout and kills what it left running."""
    pid = os.fork()
    if pid == 0:
        child(request, cwd, out, err)
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], request["timeout_s"])[0]
    os.close(pidfd)
    try:
        if ALONE:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
        else:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    status = os.waitpid(pid, 0)[1]
    try:
        while True:  # the orphans of the namespace are this init's to reap
            os.waitpid(-1, 0)
    except ChildProcessError:
        pass
    return None if timed_out else os.waitstatus_to_exitcode(status), timed_out


def tail(fd, size):
    """The last `size` bytes of a file, as text; it closes the file."""
    end = os.fstat(fd).st_size
    text = os.pread(fd, size, max(0, end - size)).decode("utf-8", "replace")
    os.close(fd)
    return text


def serve(request):
    """The answer to a request: its program run in a fresh directory, removed before the answer,
    with its stdout and stderr in files in memory (memfd), which leave nothing behind."""
    out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
    with tempfile.TemporaryDirectory(
        prefix="jspec-sandbox-", dir=request["tmp"], ignore_cleanup_errors=True
    ) as cwd:
        with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8", errors="replace") as main:
            main.write(request["source"])
        returncode, timed_out = run(request, cwd, out, err)
    return {
        "id": request["id"],  # the caller checks it: an answer a program forged is not the next's
        "stdout": tail(out, request["output_bytes"]),
        "stderr": tail(err, request["output_bytes"]),
        "returncode": returncode,
        "timed_out": timed_out,
    }


def main():
    compile("", "main.py", "exec")  # makes the ast module's ~120 classes, not each child anew
    gc.disable()  # and its objects frozen: a child's collections then leave the zygote's pages
    gc.freeze()  # unwritten, as the gc module's documentation advises before a fork
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for line in requests:
        answers.write(json.dumps(serve(json.loads(line))).encode() + b"\n")
        answers.flush()


main()
'''
)


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


def _limits(timeout_s: float, memory_mb: int) -> list[tuple[int, int]]:
    """The rlimits of a program (kind, value), each no higher than the caller's hard limit.
    RLIMIT_NPROC counts every process of the user, but in the program's own user namespace only
    the program's (and its zygote's): so it is set there, never outside one."""
    wanted = {
        resource.RLIMIT_AS: memory_mb * 2**20,
        resource.RLIMIT_CPU: math.ceil(timeout_s) + 1,
        resource.RLIMIT_FSIZE: FILE_BYTES,
        resource.RLIMIT_CORE: 0,
    }
    if namespaces():
        wanted[resource.RLIMIT_NPROC] = PROCESSES
    limits = []
    for kind, value in wanted.items():
        hard = resource.getrlimit(kind)[1]
        limits.append((kind, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return limits


class _Zygote:
    """A zygote process and its pipes, used by one thread at a time."""

    def __init__(self, program: str = ZYGOTE, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.process = subprocess.Popen(
            [*namespaces(), sys.executable, "-I", "-c", program],
            cwd="/",
            env=ENVIRONMENT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # the caller's Ctrl-C is the caller's
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests, self.answers = self.process.stdin, self.process.stdout
        self.poller = select.poll()  # not select.select: a caller may hold over 1024 files
        self.poller.register(self.answers, select.POLLIN)

    def run(self, source: str, timeout_s: float, memory_mb: int) -> Outcome:
        """The Outcome of `source`; raises where the zygote broke, took `grace_s` seconds longer
        than the timeout or answered with what is not this request's answer."""
        request = {
            "id": os.urandom(8).hex(),
            "source": source,
            "timeout_s": timeout_s,
            "limits": _limits(timeout_s, memory_mb),
            "tmp": tempfile.gettempdir(),
            "output_bytes": OUTPUT_BYTES,
        }
        self.requests.write(json.dumps(request).encode() + b"\n")
        self.requests.flush()
        if not self.poller.poll((timeout_s + self.grace_s) * 1000):
            raise TimeoutError(f"the zygote did not answer in {timeout_s + self.grace_s:.0f} s")
        answer = self.answers.readline()
        if not answer:
            raise EOFError(f"the zygote ended (status {self.process.poll()})")
        answered = json.loads(answer)
        if answered.pop("id") != request["id"]:
            raise ValueError("the zygote answered another request")
        return Outcome(**answered)

    def close(self) -> None:
        """Kills it (and with it, its namespaces and whatever runs in them)."""
        self.process.kill()
        with contextlib.suppress(OSError):
            self.requests.close()
        self.answers.close()
        self.process.wait()


# The idle zygotes, the last used at the end. list.pop and list.append are atomic, which makes
# handing them out thread-safe; a forked caller starts its own.
_IDLE: list[_Zygote] = []
os.register_at_fork(after_in_child=_IDLE.clear)


def _idle_zygote() -> _Zygote:
    """The zygote used last (its memory is warm), or a new one."""
    try:
        return _IDLE.pop()
    except IndexError:
        return _Zygote()


def close() -> None:
    """Shuts the idle zygotes down (at exit too); the next program starts a new one."""
    while _IDLE:
        with contextlib.suppress(IndexError):
            _IDLE.pop().close()


atexit.register(close)


def run_python(source: str, *, timeout_s: float = 2.0, memory_mb: int = 512) -> Outcome:
    """Runs `source` as a program in a fresh process and directory, at most `timeout_s` seconds
    of wall-clock time and `memory_mb` MiB of address space. A program whose zygote fails runs
    once more on a new zygote; a second failure is an Outcome of returncode None."""
    failure: Exception | None = None
    for attempt in range(2):
        zygote = None
        try:
            zygote = _idle_zygote() if attempt == 0 else _Zygote()
            outcome = zygote.run(source, timeout_s, memory_mb)
        except Exception as error:  # whatever broke (a forged answer too), an Outcome
            failure = error
            if zygote is not None:
                zygote.close()
            continue
        _IDLE.append(zygote)
        return outcome
    return Outcome("", f"the sandbox failed: {failure}", None, False)


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
