"""The sandbox that runs a model's programs: whatever a program does (hang, crash, exhaust memory,
reach for the network, meddle with its zygote) comes back as an Outcome, and neither the caller nor
the programs after it on the same zygote are harmed."""

import os
import resource
import time

import pytest

from jspec.rl import sandbox


def test_a_program_prints():
    out = sandbox.run_python("print(6 * 7)")
    assert out == sandbox.Outcome("42\n", "", 0, False)


def test_an_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    out = sandbox.run_python("while True:\n    pass\n", timeout_s=0.5)
    assert out.timed_out and out.returncode is None
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize(
    "bomb",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**6))"],
    ids=["one", "growing"],
)
def test_a_memory_bomb_fails_in_the_child(bomb):
    out = sandbox.run_python(bomb, timeout_s=10, memory_mb=128)
    assert out.returncode != 0 and not out.timed_out
    assert "MemoryError" in out.stderr


def test_crashes_are_outcomes():
    assert sandbox.run_python("raise SystemExit(3)").returncode == 3
    segfault = sandbox.run_python("import ctypes\nctypes.string_at(0)")
    assert segfault.returncode < 0 and not segfault.timed_out
    syntax = sandbox.run_python("def f(:\n")
    assert syntax.returncode == 1 and "SyntaxError" in syntax.stderr


def test_each_program_has_a_fresh_directory_removed_afterwards():
    show = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    first, second = (sandbox.run_python(show).stdout.splitlines() for _ in range(2))
    assert first[1] == second[1] == "['main.py']"
    assert first[0] != second[0] and first[0] != os.getcwd()
    assert not os.path.exists(first[0]) and not os.path.exists(second[0])


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("JSPEC_SANDBOX_SECRET", "hunter2")
    out = sandbox.run_python("import os, sys\nprint(sorted(os.environ), sys.flags.isolated)")
    assert out.stdout == "['LANG', 'PATH'] 1\n"


def test_stdin_is_closed():
    assert sandbox.run_python("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"


def test_the_network_is_off():
    connect = 'import socket\nsocket.create_connection(("1.1.1.1", 80), timeout=1)'
    out = sandbox.run_python(connect)
    assert out.returncode == 1 and "network access is disabled in the sandbox" in out.stderr
    if sandbox.namespaces():  # and past the prelude, there is no interface to go out of
        raw = 'import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(("1.1.1.1", 80))'
        out = sandbox.run_python(raw)
        assert out.returncode == 1 and "OSError" in out.stderr


@pytest.mark.skipif(not sandbox.namespaces(), reason="no user and pid namespaces here")
def test_a_process_that_leaves_the_session_dies_with_the_program(tmp_path):
    escaped = tmp_path / "escaped"
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(0.5)\n"
        f"    open({str(escaped)!r}, 'w').close()\n"
    )
    assert sandbox.run_python(source).returncode == 0
    time.sleep(1.0)
    assert not escaped.exists()


def test_output_is_capped_to_its_tail():
    out = sandbox.run_python("print('x' * 200_000)\nprint('end')")
    assert len(out.stdout) == sandbox.OUTPUT_BYTES and out.stdout.endswith("x\nend\n")
    assert sandbox.run_python("import sys\nsys.stdout.buffer.write(b'\\xff')").stdout == "\ufffd"


def test_the_limits_are_set_in_the_child_and_hold():
    kinds = ["AS", "CPU", "FSIZE", "CORE", "NPROC"]
    show = f"import resource as r\nprint([r.getrlimit(getattr(r, 'RLIMIT_' + k)) for k in {kinds}])"
    out = sandbox.run_python(show, timeout_s=1.5, memory_mb=256)
    processes = resource.getrlimit(resource.RLIMIT_NPROC)  # the caller's, outside namespaces
    processes = (sandbox.PROCESSES,) * 2 if sandbox.namespaces() else processes
    wanted = [(256 * 2**20,) * 2, (3, 3), (sandbox.FILE_BYTES,) * 2, (0, 0), processes]
    assert out == sandbox.Outcome(f"{wanted}\n", "", 0, False)
    big = f"import sys\nsys.stdout.write('x' * {sandbox.FILE_BYTES + 1})\nsys.stdout.flush()"
    out = sandbox.run_python(big, timeout_s=10)
    assert out.returncode == 1 and "File too large" in out.stderr


def test_run_many_keeps_order_and_runs_in_parallel():
    sources = [f"import time\ntime.sleep(0.5)\nprint({i})" for i in range(8)]
    start = time.monotonic()
    outs = sandbox.run_many(sources, workers=8)
    assert time.monotonic() - start < 2.5
    assert [o.stdout for o in outs] == [f"{i}\n" for i in range(8)]


def test_a_grandchild_dies_at_the_timeout(tmp_path):
    left = tmp_path / "left"
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(1.0)\n"
        f"    open({str(left)!r}, 'w').close()\n"
        "while True:\n"
        "    pass\n"
    )
    assert sandbox.run_python(source, timeout_s=0.5).timed_out
    time.sleep(1.5)
    assert not left.exists()


def test_the_program_starts_and_ends_as_under_python():
    source = (
        "import __main__, atexit, sys, threading, time\n"
        "print(__name__, __file__, sys.argv, __main__.__dict__ is globals())\n"
        "atexit.register(print, 'at exit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
    )
    out = sandbox.run_python(source)
    assert out == sandbox.Outcome(
        "__main__ main.py ['main.py'] True\nthread\nat exit\n", "", 0, False
    )
    assert sandbox.run_python("raise SystemExit('no')") == sandbox.Outcome("", "no\n", 1, False)
    assert sandbox.run_python("raise SystemExit").returncode == 0
    error = sandbox.run_python("\n1 / 0")  # the traceback is the program's alone
    assert error.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 2,')
    assert error.stderr.endswith("ZeroDivisionError: division by zero\n")


def one_zygote_runs(sources: list[str]) -> list[sandbox.Outcome]:
    """Runs the sources one after another on one new zygote (the last used is the next used)."""
    sandbox.close()
    outs = [sandbox.run_python(source) for source in sources]
    assert len(sandbox._IDLE) == 1
    return outs


def test_a_program_reads_no_request_and_writes_no_answer():
    meddle = (
        "import os, sys\n"
        "for fd in range(1, 11):\n"
        "    try:\n"
        '        os.write(fd, b\'{"returncode": 0, "timed_out": false}\\n\' * 1000)\n'
        "    except OSError:\n"
        "        pass\n"
        "print(repr(sys.stdin.read()), repr(os.read(0, 100)))\n"
        "print([fd for fd in range(3, 1024) if os.path.exists(f'/proc/self/fd/{fd}')])\n"
    )
    first, second, third = one_zygote_runs([meddle, "print(2)", "import sys\nsys.exit(5)"])
    assert first.stdout.endswith("'' b''\n[]\n") and first.returncode == 0
    assert second == sandbox.Outcome("2\n", "", 0, False)
    assert third == sandbox.Outcome("", "", 5, False)


def test_a_program_leaves_nothing_to_the_next_one():
    meddle = (
        "import builtins, json, os, socket, sys\n"
        "socket.socket = None\n"
        "os.environ['X'] = '1'\n"
        "sys.modules['json'] = None\n"
        "sys.path.append('/nowhere')\n"
        "builtins.len = None\n"
        "os._exit = None\n"
    )
    check = (
        "import json, os, socket, sys\n"
        "print(os.environ.get('X'), socket.socket.__name__, json.dumps(len([1])), "
        "'/nowhere' in sys.path)\n"
    )
    first, second = one_zygote_runs([meddle, check])
    assert first == sandbox.Outcome("", "", 0, False)
    assert second == sandbox.Outcome("None _NoSocket 1 False\n", "", 0, False)


def test_a_zygote_killed_from_outside_is_replaced():
    one_zygote_runs(["pass"])
    zygote = sandbox._IDLE[-1]
    zygote.process.kill()
    zygote.process.wait()
    assert sandbox.run_python("print(2)") == sandbox.Outcome("2\n", "", 0, False)
    assert sandbox._IDLE == [sandbox._IDLE[-1]] and sandbox._IDLE[-1] is not zygote


@pytest.mark.parametrize("program", ["import os\nos._exit(3)", "import time\ntime.sleep(60)"])
def test_a_broken_zygote_is_found_out_and_replaced(program):
    """A zygote that dies or never answers raises within its grace; run_python, handed one,
    runs the program on a new zygote."""
    broken = sandbox._Zygote(program, grace_s=0.5)
    start = time.monotonic()
    with pytest.raises((EOFError, TimeoutError), match="the zygote"):
        broken.run("print(1)", 0.5, 64)
    assert time.monotonic() - start < 5
    broken.close()
    sandbox._IDLE.append(sandbox._Zygote(program, grace_s=0.5))
    assert sandbox.run_python("print(1)", timeout_s=0.5) == sandbox.Outcome("1\n", "", 0, False)


FORGE = """\
import json, os
answer = json.dumps({"id": "forged", "stdout": "", "stderr": "", "returncode": 0,
                     "timed_out": False}) + "\\n"
ours = os.readlink("/proc/self/ns/pid")
for pid in [str(os.getppid())] + [pid for pid in os.listdir("/proc") if pid.isdigit()]:
    try:  # the zygote: the parent, or the init of this pid namespace
        zygote = pid == str(os.getppid()) or os.readlink(f"/proc/{pid}/ns/pid") == ours and (
            open(f"/proc/{pid}/status").read().split("NSpid:")[1].split("\\n")[0].split()[-1] == "1"
        )
        for fd in range(3, 11) if zygote else ():
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:"):
                os.write(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY), answer.encode() * 2)
    except (OSError, IndexError):
        pass
raise SystemExit(3)
"""


def test_an_answer_forged_through_proc_garbles_no_other_outcome():
    """A program can find its zygote's pipes in /proc, but an answer names its request: a forged
    one fails the forger alone, and the zygote it garbled is replaced."""
    sandbox.close()
    forged = sandbox.run_python(FORGE)
    assert forged.returncode in (None, 3) and not forged.timed_out  # 3: /proc was closed to it
    assert sandbox.run_python("print(2)") == sandbox.Outcome("2\n", "", 0, False)
    assert sandbox.run_python("print(3)") == sandbox.Outcome("3\n", "", 0, False)
