"""The planner: its activation figure is the memory a CPU run of the same train step takes, it
reads meshes and reports clearly, the README shows a report it prints today, a mixture of
experts' report states what its figures assume, and `--topology` compiles for a TPU slice with
XLA's TPU compiler on this CPU (libtpu: in the test extra; without it those tests skip).

The run is measured in a fresh process with one CPU device, glibc told to return every large
block to the system when freed (MALLOC_MMAP_THRESHOLD_), so the resident set size follows the live
buffers; a thread samples it while the step runs.
"""

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import time

import jax
import pytest
from flax import nnx

from jspec import config as config_lib
from jspec.bench import plan_check
from jspec.jobs import plan, plan_devices
from jspec.mesh import make_mesh
from jspec.models.transformer import Transformer

SMALL = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=3",
    "model.head_dim=16",
    "model.intermediate_size=256",
    "model.max_seq_len=2048",
    "rollout.max_new_tokens=16",
    "rl.prompts=1",
    "rl.group_size=2",
    "rl.sequences_per_row=1",
    "rl.loss_chunk=512",
    "rl.ttt_steps=1",
]
MESH = "data=1,stage=1,context=1,tensor=1"
SEQ = 2048


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_while(run) -> int:
    """Peak resident bytes above the level before, while `run()` executes."""
    base, peak, done = resident(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(2e-4)

    thread = threading.Thread(target=sample)
    thread.start()
    run()
    done.set()
    thread.join()
    return peak[0] - base


def measure() -> None:
    """In a fresh process: the planner's figures of the small config, then the measured peak of
    running its compiled train step on real arrays."""
    import jax
    import numpy as np
    from helpers import random_rollouts

    from jspec.mesh import make_mesh
    from jspec.models import create
    from jspec.models.draft_factory import from_config
    from jspec.rl import packing
    from jspec.rl.state import Networks, init_state, optimizer, trained_groups

    args = plan.parse_args(["--config", "demo", "--mesh", MESH, "--seq-len", str(SEQ), *SMALL])
    cfg, _ = plan.plan_config(args)
    mesh = make_mesh(cfg.mesh)
    networks, abstract = plan.abstract_networks(cfg, mesh)
    compiled, _, _ = plan.train_step(cfg, networks, abstract, SEQ, rows=1)
    policy = create(cfg.model, mesh=mesh)
    nets, params = Networks.split(policy, from_config(cfg.rollout.draft, policy, mesh=mesh), mesh)
    trained = trained_groups("cotrain", True)
    tx = optimizer(cfg.rl, trained, cfg.rl.learning_rate)
    state = init_state(nets, params, tx, trained, seed=0, reference=False)
    rollouts = random_rollouts(8, SEQ // 16, SEQ // 16, 256)
    rows = packing.pack(*rollouts, per_row=8)  # one row, its tail padding
    batch = jax.tree.map(lambda x: np.pad(x, [(0, 0), (0, SEQ - x.shape[1])]), rows)
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    measured = peak_while(lambda: jax.block_until_ready(compiled(state, batch)))
    figures = plan.Figures.of(compiled)
    print(json.dumps({"temporaries": figures.temporaries, "measured": measured}))


def test_activation_figure_is_the_measured_peak_of_a_cpu_run():
    here = pathlib.Path(__file__).parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["PYTHONPATH"] = os.pathsep.join([str(here), *sys.path])
    out = subprocess.run(
        [sys.executable, "-c", "import test_plan; test_plan.measure()"],
        env=env,
        cwd=here,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["temporaries"] > 50e6, got  # big enough to stand out of the noise
    assert abs(got["measured"] - got["temporaries"]) <= 0.15 * got["measured"], got


def test_mesh_flag_names_the_bad_item():
    assert plan.mesh_overrides("data=2,tensor=4") == ["mesh.data=2", "mesh.tensor=4"]
    with pytest.raises(config_lib.ConfigError, match=r"--mesh item 'pipe=2'"):
        plan.mesh_overrides("data=2,pipe=2")


def test_a_mesh_left_to_the_devices_is_refused():
    args = plan.parse_args(["--config", "demo"])
    with pytest.raises(config_lib.ConfigError, match="the planner needs every size"):
        plan.plan_config(args)


def test_a_row_length_the_ring_cannot_cut_is_named():
    args = plan.parse_args(["--config", "demo", "--mesh", "data=1,stage=1,context=2,tensor=1"])
    args.seq_len = 101
    with pytest.raises(config_lib.ConfigError, match=r"--seq-len=101 is not a multiple of 2 \* co"):
        plan.plan_config(args)


@pytest.mark.parametrize(
    "rows, rollout_batch, overrides, message",
    [
        (3, 2, [], r"--rows=3 training rows do not split over mesh.data=2; pass a multiple of 2"),
        (2, 2, ["pipeline.microbatches=2"], r"1 training rows do not cut into pipeline"),
        (2, 3, [], r"--rollout-batch=3 rows do not split over .* = 2; pass a multiple of 2"),
    ],
)
def test_rows_that_do_not_split_over_the_mesh_are_refused_before_compiling(
    rows, rollout_batch, overrides, message
):
    cfg = config_lib.load("tiny", ["mesh.data=2", "mesh.context=1", *overrides])
    with pytest.raises(config_lib.ConfigError, match=message):
        plan.check_batches(cfg, rows, rollout_batch)
    plan.check_batches(cfg, 4, 2)


@pytest.fixture
def planner_env(monkeypatch):
    """`plan.main` sets the jax variables for its virtual devices: put them back afterwards. The
    backend starts first, with the tests' 8 devices, so a plan's smaller count never becomes this
    process's (and the next test file's) device count."""
    jax.devices()
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))


def readme_example() -> tuple[list[str], str]:
    """(argv, printed report) of the example in README.md's "Will it fit?": the fenced block that
    starts with `$ python -m jspec.jobs.plan`."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Will it fit?", 1)[1].split("\n## ", 1)[0]
    block = next(
        b for b in section.split("```")[1::2] if b.startswith("\n$ python -m jspec.jobs.plan")
    )
    command, printed = block.strip("\n").split("\n", 1)
    return shlex.split(command)[4:], printed


def test_readme_shows_the_report_the_planner_prints(capsys, planner_env):
    """Byte for byte under the jax version the README names, so its figures cannot go stale; under
    another version (XLA's buffers change with it), the same report with every figure within 10%.
    The tests' fast-compile flags (conftest.py) change the machine code LLVM makes, not XLA's
    buffers or FLOP counts."""
    argv, printed = readme_example()
    plan.main(argv)
    got = capsys.readouterr().out.rstrip("\n")
    if f"of jax {jax.__version__} on" in printed:
        assert got == printed
        return
    number = r"\d[\d,]*\.?\d*"
    assert re.sub(number, "N", got.split(" on ", 1)[1]) == re.sub(
        number, "N", printed.split(" on ", 1)[1]
    )
    figures = lambda text: [
        float(x.replace(",", "")) for x in re.findall(number, text.split(" on ", 1)[1])
    ]
    for a, b in zip(figures(got), figures(printed), strict=True):
        assert abs(a - b) <= 0.1 * max(abs(b), 1e-9), (a, b, got)


def test_a_pipelined_config_is_planned_as_its_pipeline(planner_env):
    """With pipeline.stages > 1 the planner builds the pipelined policy train_rl runs
    (`jspec.pipeline`): a device holds its stage's layers only (the unpipelined plan's parameters
    less half the layer stack), and the train step passes the stage buffer on by
    collective-permute."""
    argv = ["--config", "tiny", "--seq-len", "128", "rollout.max_new_tokens=16"]
    argv += ["model.num_layers=4", "rl.loss_chunk=128"]
    flat = plan.main([*argv, "--mesh", "data=2,stage=1,context=1,tensor=1"])
    staged = ["pipeline.stages=2", "pipeline.microbatches=2"]
    staged += ["--mesh", "data=1,stage=2,context=1,tensor=1"]  # rows: one a microbatch
    piped = plan.main([*argv, *staged])
    cfg, seq_len = plan.plan_config(plan.parse_args([*argv, *staged]))
    policy = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    layers = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(policy.layers)))
    assert flat.parameters - piped.parameters == layers // 2
    networks, params = plan.abstract_networks(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
    compiled, _, _ = plan.train_step(cfg, networks, params, seq_len, rows=2)
    assert "collective-permute" in compiled.as_text()


def test_a_mixture_of_experts_report_states_its_assumptions(capsys, planner_env):
    tiny_moe = [
        "model.num_layers=2",
        "model.num_experts=8",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=32",
        "rollout.max_new_tokens=16",
    ]
    plan.main(["--config", "tiny", "--mesh", "data=2", "--seq-len", "128", *tiny_moe])
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == f"CPU estimate (XLA CPU compiler of jax {jax.__version__} on 2 virtual devices; "
        f"{plan.CPU_OVER_GPU} a GPU compile's peak) of tiny"
    )
    assert lines[2:5] == [
        "mixture of experts: 4 of 8 experts per device (split over data x context, 2 devices), "
        "top-2, 2 of 2 layers",
        "  dropless, no capacity factor: each device receives into 2x its own assignments "
        "(every device's tokens to it)",
        "  temporaries are an upper estimate: the CPU's grouped matmuls copy their rows per local "
        "expert (4x), a Hopper GPU's kernels do not",
    ]
    # The context axis holds experts too: Qwen3-30B-A3B on data=2 x context=4 (no compiling).
    args = ["--config", "qwen3-30b-a3b", "--mesh", "data=2,context=4,tensor=4"]
    cfg, _ = plan.plan_config(plan.parse_args(args))
    assert plan.moe_assumptions(cfg)[0].startswith(
        "mixture of experts: 16 of 128 experts per device (split over data x context, 8 devices)"
    )
    # A TPU compile's grouped matmuls are the TPU compiler's: no note on the CPU's copies.
    tpu = plan.moe_assumptions(cfg, "tpu")
    assert tpu == plan.moe_assumptions(cfg)[:2] and "CPU" not in "".join(tpu)
    # A GPU compiled for from its description cannot compile the Mosaic kernels: it says so.
    described = plan.moe_assumptions(cfg, "gpu", "h200")
    assert described[:2] == tpu and "lax.ragged_dot" in described[2]


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu (XLA's TPU compiler) is not installed: pip install -e '.[test,tpu]'",
)


@needs_libtpu
def test_a_topology_compiles_both_programs_with_the_tpu_compiler(capsys, planner_env):
    """The tiny config without a draft: an EAGLE-3 draft's co-training adds some 15 s of the TPU
    compiler's time, and its programs compile for a slice alike (the docs' Qwen3-8B report)."""
    argv = ["--config", "tiny", "--mesh", "data=2,tensor=2", "--seq-len", "128"]
    result = plan.main([*argv, "rollout.max_new_tokens=16", "--topology", "v5e:2x2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"TPU compile (XLA TPU compiler of jax {jax.__version__} for topology v5e:2x2, "
        "4 chips of TPU v5 lite) of tiny"
    )
    assert lines[1].endswith("device memory 16 GB"), lines[1]  # a v5e chip's HBM
    assert result.platform == "tpu" and result.device_kind == "TPU v5 lite" and result.chips == 4
    assert result.parameters > 0 and result.optimizer > 0
    # The train step's arguments are the state: the compiler's figure holds our count of it.
    assert result.train.arguments >= result.parameters + result.optimizer
    assert result.train.peak > result.parameters + result.optimizer
    assert result.rollout.peak > result.rollout.arguments >= result.parameters
    assert result.train.flops > 0 and result.rollout.flops > 0
    # Attention compiled by Mosaic, the Pallas TPU kernels, not XLA's path: the block kernels of
    # the train step (forward and both backward kernels) and the rollout's few-query kernel.
    kernels = ("jspec_attention_dkdv_tpu", "jspec_attention_dq_tpu", "jspec_attention_fwd_tpu")
    assert result.kernels == (*kernels, "jspec_decode_trunk_tpu"), result.kernels
    assert lines[-1].split() == [
        "Pallas",
        "kernels",
        *(k + "," for k in kernels),
        "jspec_decode_trunk_tpu",
    ]


@needs_libtpu
def test_a_mixture_of_experts_compiles_for_a_slice(capsys, planner_env):
    """The sparse MLP's grouped products are `lax.ragged_dot`, which XLA's TPU compiler lowers
    itself (on the CPU host jspec picks it, as it would on a TPU)."""
    moe = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=64"]
    argv = ["--config", "tiny", "--mesh", "data=2,tensor=2", "--seq-len", "128", *moe]
    result = plan.main([*argv, "rollout.max_new_tokens=16", "--topology", "v5e:2x2"])
    out = capsys.readouterr().out
    assert "mixture of experts: 4 of 8 experts per device" in out
    assert result.platform == "tpu" and result.train.flops > 0 and result.rollout.flops > 0


@needs_libtpu
def test_a_mesh_that_does_not_fit_the_slice_is_refused_before_compiling(monkeypatch, planner_env):
    """A v4 chip is two devices (its cores), so v4:2x2x1's 4 chips are 8 devices to the mesh."""

    def compiled(*_):
        raise AssertionError("compiling began")

    monkeypatch.setattr(plan, "abstract_networks", compiled)
    argv = ["--config", "tiny", "--mesh", "data=4", "--topology", "v4:2x2x1"]
    message = (
        r"mesh .* has 4 positions, the TPU slice has 8 devices \(4 chips of TPU v4, 2 devices "
        r"each\); pass a --mesh whose sizes multiply to 8, e.g. --mesh data=8"
    )
    with pytest.raises(config_lib.ConfigError, match=message):
        plan.main(argv)


@needs_libtpu
def test_a_tpu_device_has_its_chip_s_memory_unless_told(planner_env):
    v4 = plan_devices.topology_devices("v4:2x2x1")
    assert plan_devices.device_memory(v4, None, "v4:2x2x1") == 16.0  # 32 GB a chip, two devices
    assert plan_devices.device_memory(v4, 20.0, "v4:2x2x1") == 20.0  # --memory wins
    v5p = plan_devices.topology_devices("v5p:2x2x1")
    assert plan_devices.device_memory(v5p, None, "v5p:2x2x1") == 95.0
    assert plan_devices.device_memory(jax.devices("cpu"), None, None) == 141.0  # an H200's


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p-16", "tpu9:2x2", "v5p:3x3x3"])
def test_a_topology_libtpu_does_not_know_is_a_clear_error(name, planner_env):
    argv = ["--config", "tiny", "--mesh", "data=4", "--topology", name]
    with pytest.raises(config_lib.ConfigError, match=rf"--topology '{name}': libtpu does not know"):
        plan.main(argv)


def test_a_topology_without_libtpu_names_the_install(monkeypatch, planner_env):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # find_spec then finds no libtpu
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    argv = ["--config", "tiny", "--mesh", "data=4", "--topology", "v5p:2x2x1"]
    with pytest.raises(config_lib.ConfigError, match=r"v5p:2x2x1.*pip install -e '\.\[tpu\]'"):
        plan.main(argv)


def test_without_a_gpu_the_gpu_plan_is_refused_before_compiling(planner_env):
    with pytest.raises(config_lib.ConfigError, match=r"--gpu: this machine has no GPU"):
        plan.main(["--config", "tiny", "--mesh", "data=1", "--gpu"])


@pytest.mark.parametrize("program", plan_check.PROGRAMS)
def test_the_plan_check_runs_the_planned_program_on_inputs_of_its_shapes(monkeypatch, program):
    """What `jspec.bench.plan_check` runs on the GPU to measure a program's peak, on the CPU:
    the program the planner compiles, called on inputs made from its abstract arguments."""
    monkeypatch.setitem(plan_check.CASES, "tiny", ("tiny", (), 64, 2, 2))
    compiled, abstract = plan_check.compiled_program("tiny", program, jax.devices()[:1])
    jax.block_until_ready(compiled(*plan_check.materialize(abstract)))
    figures = plan_check.measure("tiny", program, "cpu")
    assert figures["planned_above_inputs"] == plan.Figures.of(compiled).temporaries + (
        figures["outputs"] - figures["aliased"]
    )


@pytest.mark.parametrize(
    "topology, message",
    [
        ("8-8", r"write HOSTSxGPUS"),
        ("0x8", r"write HOSTSxGPUS"),
        ("2x4", r"this machine has no GPU"),
    ],
)
def test_a_gpu_topology_is_checked_before_compiling(topology, message, planner_env):
    with pytest.raises(config_lib.ConfigError, match=message):
        plan.main(["--config", "tiny", "--mesh", "data=8", "--gpu-topology", topology])


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--gpu-topology", "1x2", "--gpu-target", "b100"],
            r"--gpu-target b100: no such GPU description; name one of h100, h200",
        ),
        (["--gpu-target", "h200"], r"--gpu-target describes the GPUs, --gpu-topology HOSTSxGPUS"),
        (["--gpu-topology", "1x2", "--gpu-target", "missing.txtpb"], r"no such GPU description"),
    ],
)
def test_a_gpu_target_is_checked_before_compiling(extra, message, planner_env):
    with pytest.raises(config_lib.ConfigError, match=message):
        plan.main(["--config", "tiny", "--mesh", "data=2", *extra])


def test_a_gpu_target_without_the_cuda_plugin_names_the_install(monkeypatch, planner_env):
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
        monkeypatch.setitem(sys.modules, name, None)  # find_spec then finds no plugin
    argv = ["--config", "tiny", "--mesh", "data=2", "--gpu-topology", "1x2", "--gpu-target", "h200"]
    with pytest.raises(config_lib.ConfigError, match=r"h200.*pip install -e '\.\[gpu\]'"):
        plan.main(argv)


needs_cuda_plugin = pytest.mark.skipif(
    not plan_devices.has_cuda_plugin(),
    reason="jax's CUDA plugin (XLA's GPU compiler) is not installed: pip install -e '.[gpu]'",
)


@needs_cuda_plugin
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_gpu_target_compiles_both_programs_without_a_gpu(moe, capsys, planner_env):
    """XLA's GPU compiler on this host, for two H200s it only knows from their description: the
    programs hold the Pallas GPU kernels a GPU run would, though no GPU is here to run them (a
    mixture of experts' grouped products are lax.ragged_dot, and the report says so)."""
    argv = ["--config", "tiny", "--mesh", "data=2", "--seq-len", "128", "rollout.max_new_tokens=16"]
    experts = ["model.num_experts=8", "model.num_experts_per_tok=2"]
    experts += ["model.moe_intermediate_size=64"]
    result = plan.main([*argv, *experts * moe, "--gpu-topology", "1x2", "--gpu-target", "h200"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == (
        f"GPU compile (XLA GPU compiler of jax {jax.__version__} for topology 1x2, 2 chips of "
        "NVIDIA H200 141GB HBM3e; from --gpu-target h200, no GPU: untuned) of tiny"
    )
    assert lines[1].endswith("device memory 113.548 GB"), lines[1]  # jax's 75% of 141 GiB
    assert ("grouped products as lax.ragged_dot" in out) is moe
    assert result.platform == "gpu" and result.chips == 2
    assert result.train.peak > result.parameters + result.optimizer > 0
    assert result.train.flops is None and "not known (XLA analyses no cost" in out
    kernels = ("jspec_attention_dkdv", "jspec_attention_dq", "jspec_attention_fwd")
    assert result.kernels == (*kernels, "jspec_decode_trunk"), result.kernels


@needs_cuda_plugin
@pytest.mark.parametrize("program", plan_check.PROGRAMS)
def test_the_plan_check_compiles_for_a_described_gpu(monkeypatch, program):
    monkeypatch.setitem(plan_check.CASES, "tiny", ("tiny", (), 64, 2, 2))
    figures = plan_check.measure("tiny", program, "described", "h200")
    assert figures["planned_above_inputs"] > 0 and figures["flops"] is None
    assert "measured_above_inputs" not in figures  # nothing runs without the GPU


def test_the_plan_check_table_has_a_column_for_every_figure():
    figures = lambda planned: {"planned_above_inputs": planned}
    row = {"case": "c", "program": "train", "measured": 2e9}
    row |= {p: figures(x) for p, x in zip(plan_check.PLATFORMS, (2e9, 2.2e9, 3e9), strict=True)}
    header, rule, line = plan_check.table([row]).splitlines()
    assert header.count("|") == rule.count("|") == line.count("|")
    assert line == "| c | train | 2.00 | 2.00 | 1.000 | 2.20 | 1.100 | 3.00 | 1.500 |"
