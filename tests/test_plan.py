"""The planner: its activation figure is the memory a CPU run of the same train step takes, and
it reads meshes and reports clearly.

The run is measured in a fresh process with one CPU device, glibc told to return every large
block to the system when freed (MALLOC_MMAP_THRESHOLD_), so the resident set size follows the live
buffers; a thread samples it while the step runs.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from jspec import config as config_lib
from jspec import plan

SMALL = [
    "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=3", "model.head_dim=16",
    "model.intermediate_size=256", "model.max_seq_len=2048", "rollout.max_new_tokens=16",
    "rl.prompts=1", "rl.group_size=2", "rl.sequences_per_row=1", "rl.loss_chunk=512",
    "rl.ttt_steps=1",
]  # fmt: skip
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
    from jspec.models.draft import from_config
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
        env=env, cwd=here, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["temporaries"] > 50e6, got  # big enough to stand out of the noise
    assert abs(got["measured"] - got["temporaries"]) <= 0.15 * got["measured"], got


def test_mesh_flag_names_the_bad_item():
    mesh = config_lib.MeshConfig()
    assert plan.mesh_sizes("data=2,tensor=4", mesh) == config_lib.MeshConfig(data=2, tensor=4)
    with pytest.raises(config_lib.ConfigError, match=r"--mesh item 'pipe=2'"):
        plan.mesh_sizes("data=2,pipe=2", mesh)


def test_a_mesh_left_to_the_devices_is_refused():
    args = plan.parse_args(["--config", "demo"])
    with pytest.raises(config_lib.ConfigError, match="the planner needs every size"):
        plan.plan_config(args)
