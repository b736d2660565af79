"""The cluster manifests start: their train_rl commands pass the trainer's own validation
(`rl_run.check`) for the cluster they describe, and so does every shipped config with an RL
section, on the devices its mesh names."""

import functools
import math
import pathlib
import re
import shlex

import pytest
import yaml

from jspec import config as config_lib
from jspec.jobs import rl_run, train_rl
from jspec.rl import tasks

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
    rl_run.check(cfg, parsed.draft_mode, devices, processes)


def rl_configs() -> list[str]:
    names = sorted(p.stem for p in config_lib.CONFIG_DIR.glob("*.yaml"))
    return [n for n in names if config_lib.load(n).rl is not None]


def task_tokenizer(directory, task) -> str:
    """A byte-level BPE of the task's own text (a code model's stand-in, for the code task whose
    answers do not fit the rollouts in bytes), ending at <eos>, as a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [t for p in tasks.problems(task, 0, 200, seed=0) for t in (p.prompt, p.answer)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<eos>"]))
    tok.save(str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


@pytest.mark.parametrize("name", rl_configs())
def test_every_shipped_rl_config_passes_the_trainers_validation(name, tmp_path, monkeypatch):
    # Widths from 256 problems of each task, not 1,024: the code task's hardest take ~0.1 s each.
    monkeypatch.setattr(tasks, "widths", functools.partial(tasks.widths, samples=256))
    cfg = config_lib.load(name)
    if cfg.rl.task.name == "code":  # for a trained code model (rl.policy), with its BPE
        bpe = task_tokenizer(tmp_path, cfg.rl.task)
        cfg = config_lib.load(name, [f"rl.tokenizer={bpe}", "rl.eos_token=<eos>"])
    sizes = [getattr(cfg.mesh, axis) for axis in ("data", "stage", "context", "tensor")]
    devices = 8 if -1 in sizes else math.prod(sizes)
    rl_run.check(cfg, "cotrain", devices)


def test_a_config_naming_a_tokenizer_json_passes_and_one_without_its_end_token_is_named(tmp_path):
    """rl.tokenizer: a tokenizer.json (here a tiny BPE trained on the task's alphabet) gives the
    run its vocabulary and end id; without rl.eos_token the run is refused, the fix named."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["47+85=7+5+0=12,4+8+1=13;132", "sort 3142=1234"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    name = f"rl.tokenizer={tmp_path / 'tokenizer.json'}"
    cfg = config_lib.load("demo", [name, "rl.eos_token=<|endoftext|>", "rollout.eos_id=null"])
    checked, tokenizer, _ = rl_run.check(cfg, "cotrain", 8)
    assert checked.rollout.eos_id == tokenizer.eos_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(config_lib.ConfigError, match=r"needs rl.eos_token, the token that ends"):
        rl_run.check(config_lib.load("demo", [name, "rollout.eos_id=null"]), "cotrain", 8)
