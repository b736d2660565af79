"""Every console script jspec's installed distribution declares, run as the shell runs it: the
script file the installer wrote (beside `sys.executable`) in a fresh process, on the CPU with the
session's XLA flags (tests/conftest.py put them in os.environ; the process inherits them). The
other tests call the jobs' `main` (or `python -m`); only here do the entry points of pyproject.toml,
`jspec.jobs.cli.run` and the exit statuses a shell or a cluster's scheduler sees get run.

A tiny run that does real work exits 0 with no traceback, and a bad argument (an unknown flag, a
number out of its flag's range, or a config value `jspec.jobs.cli.run` turns into `error: ...`)
exits 2 with no traceback. The
scripts are read from the distribution's metadata, so a new one fails here until ARGS has a line
for it. `jspec-check-gpu-attention` cannot succeed without a GPU: here it must refuse with its
one-line explanation and no traceback, and its `--help` must exit 0.
"""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest
from helpers import LOOP

import jspec

try:
    SCRIPTS = sorted(
        e.name
        for e in importlib.metadata.distribution("jspec").entry_points
        if e.group == "console_scripts"
    )
except importlib.metadata.PackageNotFoundError:  # a checkout run without installing: no scripts
    pytest.skip("jspec is not installed: no console scripts to run", allow_module_level=True)
# script: (a tiny successful run, a bad argument); {tmp}: the working directory, which holds
# run/metrics.jsonl; {cache}: the session's compilation cache; {src}: the jspec package's sources.
ARGS = {
    "jspec-train-rl": (
        f"{' '.join(LOOP)} rl.steps=1 rl.sft_steps=1 --run-dir {{tmp}}/rl "
        "--compilation-cache {cache} --quiet",
        "rl.steps=x",
    ),
    "jspec-demo": (
        "--config tiny model.num_layers=1 rollout.max_new_tokens=4 --batch 1 --prompt-len 4",
        "model.no_such_field=1",
    ),
    "jspec-plan": (
        "--config tiny model.num_layers=1 rollout.max_new_tokens=4 --seq-len 32 "
        "--mesh data=1,stage=1,context=1,tensor=1",
        "--config tiny --mesh data=1,pipe=2",
    ),
    "jspec-launch": ("plot_runs run --out launched.png", "no_such_job"),
    "jspec-plot-runs": ("run --out runs.png", "run --no-such-flag"),
    "jspec-bench-attention": (
        "--device cpu --cp 2 --methods ring --seq 1024 --mean-doc 1024 --heads 2 --kv-heads 1 "
        "--head-dim 8 --iters 1 --json attention.json",
        "--iters 0",
    ),
    "jspec-bench-moe": (
        "--device cpu --ep 1 --batch 1 --seq 8 --decode-batch 2 --iters 1 --json moe.json",
        "--ep 0",
    ),
    "jspec-bench-rollout": (
        "--device cpu --config tiny model.num_layers=1 --batches 1 --prompt-len 8 "
        "--new-tokens 4 --tree-sizes --no-spec --iters 1 --prompts-per-row 1 "
        "--acceptance-rows 1 --out rollout.json",
        "--device cpu --config tiny rollout.no_such_field=1",
    ),
    "jspec-bench-pipeline": (
        "--device cpu --set model.num_layers=2 --batch 2 --seq 8 --stages 2 --microbatches 2 "
        "--repeats 1 --iters 1 --json pipeline.json",
        "--stages 0",
    ),
    "jspec-bench-async-rl": (  # on two devices (DEVICES): one RL step, no warm start
        "--small --steps 1 --skip 0 --drafts none --modes sync rollout.max_new_tokens=4 "
        "rl.task.name=sorting rl.task.difficulty=1 rl.prompts=2 rl.group_size=2 "
        "rl.sequences_per_row=2 rl.loss_chunk=16 rl.sft_steps=0 --out async.json",
        "--steps 0",
    ),
    "jspec-bench-decode-kernel": (
        "--device cpu --batches 1 --queries 1 --slots 16 --heads 2 --kv-heads 1 --head-dim 16 "
        "--block-k 16 --num-warps 4 --num-stages 2 --target-programs 1 --iters 1 --out dk.json",
        "--batches 0",
    ),
    "jspec-train-code-lm": (
        "--config tiny model.vocab_size=512 model.num_layers=3 --roots {src} --max-bytes 200000 "
        "--heldout 4 --steps 1 --draft-steps 1 --ttt-steps 1 --batch 1 --data-parallel 1 "
        "--seq-len 32 --eval-batches 1 --save-minutes 1000 --run-dir code",
        "--config tiny --batch 3 --data-parallel 2 --run-dir code",
    ),
    "jspec-check-gpu-attention": ("--no-sweep", "--budget 0"),  # refuses: GPU_ONLY
}
DEVICES = {"jspec-bench-async-rl": 2}  # virtual CPU devices where not the session's 8
GPU_ONLY = {"jspec-check-gpu-attention": "needs an NVIDIA GPU"}  # its refusal on the CPU


def run(script: pathlib.Path, args: str, cwd: pathlib.Path, devices: int | None, **values):
    """The finished process of `script args` (placeholders filled from `values`) in `cwd`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JSPEC_DEBUG", None)  # it would turn `error: ...` into a traceback
    if devices:
        count = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = re.sub(
            r"--xla_force_host_platform_device_count=\d+", count, env["XLA_FLAGS"]
        )
    argv = [str(script), *(a.format(**values) for a in args.split())]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", SCRIPTS)
def test_console_script_runs_and_refuses_a_bad_argument(name, tmp_path, compilation_cache):
    if name not in ARGS:
        pytest.fail(
            f"{name} has no arguments: add a tiny successful run and a bad argument for it to "
            f"ARGS in {pathlib.Path(__file__).name}"
        )
    script = pathlib.Path(sys.executable).absolute().parent / name
    if not script.is_file():
        pytest.skip(f"{script} is absent (jspec not installed into this environment's scripts)")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        '{"step": 0, "reward": 0.1, "accepted_length": 1.5, "agreement": 0.3}\n'
        '{"step": 1, "reward": 0.2, "accepted_length": 1.7, "agreement": 0.4}\n'
    )
    values = dict(tmp=tmp_path, cache=compilation_cache, src=pathlib.Path(jspec.__file__).parent)
    good, bad = ARGS[name]
    devices = DEVICES.get(name)

    out = run(script, good, tmp_path, devices, **values)
    tail = f"{name} {good}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stdout + out.stderr, tail
    if name in GPU_ONLY:
        last_line = out.stderr.strip().rsplit("\n", 1)[-1]
        assert out.returncode != 0 and GPU_ONLY[name] in last_line, tail
        assert run(script, "--help", tmp_path, devices).returncode == 0
    else:
        assert out.returncode == 0, tail

    out = run(script, bad, tmp_path, devices, **values)
    tail = f"{name} {bad}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 2 and "error:" in out.stderr, tail
    assert "Traceback" not in out.stdout + out.stderr, tail
