"""The sandbox that runs a model's programs: whatever a program does (hang, crash, exhaust memory,
reach for the network) comes back as an Outcome, and the caller is unharmed."""

import os
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


def test_run_many_keeps_order_and_runs_in_parallel():
    sources = [f"import time\ntime.sleep(0.5)\nprint({i})" for i in range(8)]
    start = time.monotonic()
    outs = sandbox.run_many(sources, workers=8)
    assert time.monotonic() - start < 2.5
    assert [o.stdout for o in outs] == [f"{i}\n" for i in range(8)]
