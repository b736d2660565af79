"""The cluster manifests start: their train_rl commands pass the trainer's own validation
(`train_rl.check`) for the cluster they describe, and so does every shipped config with an RL
section, on the devices its mesh names."""

import math
import pathlib
import re
import shlex

import pytest
import yaml

from jspec import config as config_lib
from jspec.launch import train_rl

LAUNCH = pathlib.Path(__file__).resolve().parent.parent / "launch"


def slurm_command() -> tuple[list[str], int, int]:
    """(train_rl's arguments, processes, devices) of launch/slurm.sbatch: its usage line's
    arguments after the script, and the flags of srun's line, on its nodes' GPUs."""
    text = (LAUNCH / "slurm.sbatch").read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    usage = re.search(r"#\s+sbatch launch/slurm.sbatch (.*)", text).group(1)
    srun = re.search(r"jspec-launch train_rl (.*)", text).group(1).replace('"$@"', "")
    args = shlex.split(srun.replace('"$RUN_DIR"', "runs/slurm")) + shlex.split(usage)
    return args, nodes, nodes * gpus


def jobset_command() -> tuple[list[str], int, int]:
    """(train_rl's arguments, processes, devices) of launch/jobset.yaml."""
    spec = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())["spec"]["replicatedJobs"][0]
    job = spec["template"]["spec"]
    pods = job["parallelism"] * spec["replicas"]
    (container,) = job["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["jspec-launch", "train_rl"], command
    return command[2:], pods, pods * container["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("manifest", [slurm_command, jobset_command], ids=["slurm", "jobset"])
def test_the_manifests_commands_pass_the_trainers_validation(manifest):
    args, processes, devices = manifest()
    parsed = train_rl.parse_args(args)
    cfg = config_lib.load(parsed.config, parsed.overrides)
    train_rl.check(cfg, parsed.draft, devices, processes)


def rl_configs() -> list[str]:
    names = sorted(p.stem for p in config_lib.CONFIG_DIR.glob("*.yaml"))
    return [n for n in names if config_lib.load(n).rl is not None]


@pytest.mark.parametrize("name", rl_configs())
def test_every_shipped_rl_config_passes_the_trainers_validation(name):
    cfg = config_lib.load(name)
    sizes = [getattr(cfg.mesh, axis) for axis in ("data", "stage", "context", "tensor")]
    devices = 8 if -1 in sizes else math.prod(sizes)
    train_rl.check(cfg, "cotrain", devices)
