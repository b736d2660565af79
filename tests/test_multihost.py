"""Multi-host runs: two processes of four CPU devices each (gloo collectives) run the RL demo over
one 8-device mesh, each loading its own rows (or, with a data axis of 1, both the same rows), and
match one process of eight devices; and the launcher reads SLURM, Kubernetes and explicit
settings."""

import json
import os
import socket
import subprocess
import sys
import types

import numpy as np
import pytest

from jspec import hosts
from jspec.config import ConfigError
from jspec.jobs import distributed, train_rl

# The test loop of tests/test_rl.py, two RL steps (rollouts, rewards, packing and a co-training
# step on each host's rows) from the initial weights: compiling dominates, so no warm start.
LOOP = [
    "model.hidden_size=32",
    "model.num_layers=3",
    "model.head_dim=8",
    "model.intermediate_size=64",
    "rl.task.name=sorting",
    "rl.task.difficulty=1",
    "rollout.max_new_tokens=6",
    "rl.prompts=8",
    "rl.group_size=8",
    "rl.sequences_per_row=2",
    "rl.sft_batch=16",
    "rl.ttt_steps=1",
    "rl.loss_chunk=16",
    "rl.save_every=1",
    "rl.steps=2",
    "rl.sft_steps=0",
    "--compilation-cache",
    "",
    "--quiet",
]
COMPARED = ("reward", "policy_loss", "draft_loss", "accepted_length", "agreement", "rollout_tokens")
# Rows split between the hosts (the data axis), and rows both hosts hold (a tensor axis of 8).
WIDE = ["model.num_heads=8", "model.num_kv_heads=8", "rollout.draft.vocab_size=264"]
LAYOUTS = {"data": [], "replicated": ["mesh.data=1", "mesh.tensor=8", *WIDE]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def two_processes(run_dir, layout):
    """The demo loop under jspec-launch as processes 0 and 1 of 2, four CPU devices each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # the session's flags (tests/conftest.py: fast compilation), four devices per process
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    address = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jspec.jobs.distributed",
                "--coordinator",
                address,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "train_rl",
                *LOOP,
                *layout,
                "--run-dir",
                str(run_dir),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_match_one(tmp_path, layout):
    two_processes(tmp_path / "two", LAYOUTS[layout])
    train_rl.main([*LOOP, *LAYOUTS[layout], "--run-dir", str(tmp_path / "one")])
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [0, 1]
    for a, b in zip(one, two, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # The processes wrote each checkpoint together, and the metrics once (process 0).
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["1", "2"]


def flags(**kw):
    return types.SimpleNamespace(
        **{"coordinator": None, "num_processes": None, "process_id": None, **kw}
    )


@pytest.mark.parametrize(
    "args, env, want",
    [
        (flags(), {}, None),
        (
            flags(coordinator="h:1", num_processes=4, process_id=3),
            {},
            dict(coordinator_address="h:1", num_processes=4, process_id=3),
        ),
        (
            flags(),
            {
                "JOB_COMPLETION_INDEX": "2",
                "JSPEC_NUM_PROCESSES": "4",
                "JOBSET_NAME": "rl",
                "REPLICATED_JOB_NAME": "workers",
            },
            dict(coordinator_address="rl-workers-0-0.rl:8476", num_processes=4, process_id=2),
        ),
        (flags(), {"SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[01-08]"}, {}),
        (flags(), {"SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "gpu01"}, None),
    ],
)
def test_cluster_settings(args, env, want):
    assert distributed.cluster(args, env) == want


def test_incomplete_cluster_settings_name_what_is_missing():
    with pytest.raises(ConfigError, match="missing: num-processes, process-id"):
        distributed.cluster(flags(coordinator="h:1"), {})
    with pytest.raises(ConfigError, match="--process-id=4 must be in"):
        distributed.cluster(flags(coordinator="h:1", num_processes=4, process_id=4), {})


def three_processes(monkeypatch, blocks, values):
    """`hosts.gather` as three processes holding row blocks `blocks` see it: each process's
    `process_allgather` returns every process's value, stacked."""
    monkeypatch.setattr(hosts.jax, "process_count", lambda: 3)
    answers = iter([np.array([[b.start, b.stop] for b in blocks]), np.stack(values)])
    monkeypatch.setattr(hosts.multihost_utils, "process_allgather", lambda x: next(answers))


def test_gather_counts_a_block_that_several_processes_hold_once(monkeypatch):
    blocks = [slice(4, 8), slice(0, 4), slice(4, 8)]  # processes 0 and 2 hold the same rows
    three_processes(monkeypatch, blocks, [np.array([5, 6]), np.array([1, 2]), np.array([5, 6])])
    np.testing.assert_array_equal(hosts.gather(np.array([5, 6]), blocks[0]), [1, 2, 5, 6])


def test_gather_refuses_blocks_that_overlap(monkeypatch):
    blocks = [slice(0, 4), slice(2, 6), slice(4, 8)]
    three_processes(monkeypatch, blocks, [np.zeros(2)] * 3)
    with pytest.raises(ValueError, match="do not split the rows into disjoint blocks"):
        hosts.gather(np.zeros(2), blocks[0])
