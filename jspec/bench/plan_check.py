"""The planner's figures against the memory its programs take when they run, on this machine's GPU.

    python -m jspec.bench.plan_check                  # on a GPU machine: every case below
    python -m jspec.bench.plan_check --cases code-rl  # one of them

For each case (a config and its overrides, tokens per training row, training rows, the rollout's
batch) and each of its two programs (the co-training train step, the speculative rollout), a
fresh process compiles the program as `python -m jspec.jobs.plan --gpu` does, for the first GPU,
runs it once on inputs of the planned shapes and shardings (zeros, the rollout's prompts of one
token: the memory is static), and reads the device's peak: the peak above the inputs is what the
planner calls temporaries plus the outputs not aliased to donated inputs. Two more processes, with
no GPU in sight (JAX_PLATFORMS=cpu), give the figures of the same program compiled for the GPU
`--gpu-target` describes (`python -m jspec.jobs.plan --gpu-target`: no autotuning) and the CPU
estimate (`python -m jspec.jobs.plan`). Prints a Markdown table (each against the measured peak)
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from jspec.jobs import cli, plan, plan_devices

# name: (config, overrides, tokens per training row, training rows, rollout batch). The Qwen3-8B
# shape keeps 12 of its 36 layers, so that its float32 parameters and Adam state fit one H200.
CASES = {
    "code-rl": ("code-rl", (), 3200, 16, 128),
    "qwen3-8b-12-layers": (
        "qwen3-8b",
        ("model.num_layers=12", "model.tap_layers=[1,5,9]", "rollout.max_new_tokens=1024"),
        8192,
        1,
        16,
    ),
}
PROGRAMS = ("train", "rollout")
PLATFORMS = ("gpu", "described", "cpu")  # this GPU's compile, a described GPU's, the CPU estimate
TIMEOUT_S = 900  # for one program's process: compile, run, compile for the CPU


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_plan_check.json"))
    p.add_argument("--gpu-target", default="h200", help="the GPU description (as the planner's)")
    p.add_argument("--measure", nargs=4, metavar=("CASE", "PROGRAM", "PLATFORM", "TARGET"))
    return p.parse_args(argv)


def compiled_program(case: str, program: str, devices):
    """(the compiled `program` of `case` for `devices`, its abstract arguments)."""
    name, overrides, seq_len, rows, batch = CASES[case]
    cfg, networks, params = plan.on_one_device(name, overrides, seq_len, devices[0])
    if program == "train":
        compiled, state, packed = plan.train_step(cfg, networks, params, seq_len, rows)
        return compiled, (state, packed)
    return plan.rollout_step(cfg, networks, params, seq_len - cfg.rollout.max_new_tokens, batch)


def materialize(abstract):
    """Arrays of `abstract`'s shapes, dtypes and shardings: zeros (typed keys from seed 0)."""

    def make(s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
        return jnp.ones(s.shape, s.dtype) if s.dtype == jnp.int32 else jnp.zeros(s.shape, s.dtype)

    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(make, abstract), out_shardings=shardings)()


def measure(case: str, program: str, platform: str, gpu_target: str = "h200") -> dict:
    """The planner's figures of one program compiled for `platform` ('gpu': this machine's first
    GPU, also run there for its measured peak above the inputs; 'described': one GPU of the
    description `gpu_target`; 'cpu': one virtual CPU device)."""
    if platform == "gpu":
        devices = plan_devices.gpu_devices(1)
    elif platform == "described":
        devices = plan_devices.gpu_topology_devices("1x1", plan_devices.gpu_target(gpu_target))
    else:
        devices = jax.devices("cpu")[:1]
    compiled, abstract = compiled_program(case, program, devices)
    figures = plan.Figures.of(compiled)
    out = {"planned_above_inputs": figures.peak - figures.arguments, **figures._asdict()}
    if platform == "gpu":
        out["measured_above_inputs"] = peak_above_inputs(compiled, abstract, devices[0])
    return out


def peak_above_inputs(compiled, abstract, device) -> int:
    """Bytes `device` held at its peak beyond the inputs while `compiled` ran once on inputs of
    `abstract`'s shapes (the device's first peak in this process: nothing before it may be
    larger)."""
    args = jax.block_until_ready(materialize(abstract))
    stats = device.memory_stats()
    jax.block_until_ready(compiled(*args))
    peak = device.memory_stats()["peak_bytes_in_use"]
    if peak <= stats["peak_bytes_in_use"]:  # an earlier peak (the inputs', autotuning's) hides it
        raise RuntimeError(
            f"the run's peak ({peak:,} bytes) does not stand above this process's earlier one; "
            "its own peak cannot be read"
        )
    return peak - stats["bytes_in_use"]


def in_process(case: str, program: str, platform: str, gpu_target: str) -> dict:
    """`measure` in a process of its own: the device's peak counts that program alone."""
    env = dict(os.environ)
    if platform != "gpu":
        env["JAX_PLATFORMS"] = "cpu"
    module = "jspec.bench.plan_check"
    command = [sys.executable, "-m", module, "--measure", case, program, platform, gpu_target]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    gb = lambda x: f"{x / plan.GB:.2f}"
    lines = [
        "| case | program | measured GB | GPU compile GB | / measured | described GPU (no GPU) GB "
        "| / measured | CPU estimate GB | / measured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["measured"]
        planned = (r[p]["planned_above_inputs"] for p in PLATFORMS)
        lines.append(
            f"| {r['case']} | {r['program']} | {gb(m)} | "
            + " | ".join(f"{gb(x)} | {x / m:.3f}" for x in planned)
            + " |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    plan_devices.gpu_devices(1)  # clear errors before any process starts
    plan_devices.gpu_target(args.gpu_target)
    rows = []
    for case in args.cases:
        for program in PROGRAMS:
            figures = {p: in_process(case, program, p, args.gpu_target) for p in PLATFORMS}
            measured = figures["gpu"]["measured_above_inputs"]
            rows.append({"case": case, "program": program, "measured": measured, **figures})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    args.out.write_text(
        json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    sys.exit(cli.run(main))
