"""`jspec/jobs/train_code_lm.py` at toy size, its batch split over two devices: a run that stops
at its time limit or dies in the middle of a stage resumes from its newest step checkpoint and
ends where the uninterrupted run ends, its metrics too; a stage's checkpoint that does not restore
is set aside, and one written with other flags is refused unless allowed (`jspec.jobs.trainer`,
as train_rl's)."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec import config as config_lib
from jspec import tokenizers
from jspec.bench import rollout as bench_rollout
from jspec.config import ConfigError, DraftConfig
from jspec.jobs import code_corpus, plan_devices, train_code_lm, trainer
from jspec.models import draft_factory, hf, hf_eagle3, hf_mtp
from jspec.models.block import BlockDraft
from jspec.models.mtp import MTPConfig, create_mtp

ARGS = (
    "--config tiny model.vocab_size=512 --steps 4 --draft-steps 4 --batch 2 --seq-len 64 "
    "--max-bytes 1000000 --eval-batches 1 --save-minutes 0 --heldout 4 --data-parallel 2"
).split()


def bench_args(run):
    """The rollout benchmark's arguments for `run`: its held-out prompts of 16 tokens, 2 rows."""
    argv = ["--trained", str(run), "--prompt-len", "16", "--batches", "1"]
    return bench_rollout.parse_args([*argv, "--prompts-per-row", "1", "--acceptance-rows", "2"])


class Died(Exception):
    pass


def test_a_step_beyond_the_gpus_memory_is_refused_before_it_runs(tmp_path, monkeypatch):
    """The target's step, compiled, is held against the device's memory (here a limit of 1 KB
    where a GPU's would be read): refused with the peak, the limit and the fixes, before a step
    or checkpoint is written."""
    check = plan_devices.check_fits
    monkeypatch.setattr(plan_devices, "check_fits", lambda *a: check(*a, limit=1000))
    with pytest.raises(
        ConfigError,
        match=r"target stage's train step needs .* GB a device.*"
        r"model\.remat=full.*--batch",
    ):
        train_code_lm.main([*ARGS, "--run-dir", str(tmp_path)])
    assert not (tmp_path / "training/target/metrics.jsonl").exists()
    assert not list((tmp_path / "training/target").glob("checkpoints/*"))
    check(10**9, "a step", "a fix", limit=10**9)  # at the limit: it fits


def test_a_run_that_stops_or_dies_mid_stage_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A run stopped at its time limit (`--stop-after 0`: after one step; its own process, as a
    job's restart is) exits 75 with its step saved; resumed, it dies in the draft stage; resumed
    again, it ends bit-equal to one uninterrupted run."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_code_lm.main([*ARGS, "--run-dir", str(whole)])
    args = [*ARGS, "--run-dir", str(killed)]
    stopped = subprocess.run(
        [sys.executable, "-m", "jspec.jobs.train_code_lm", *args, "--stop-after", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == trainer.EXIT_RESUME, stopped.stderr[-2000:]
    assert "target: stopped at the time limit after step 1" in stopped.stdout

    sampler, calls = train_code_lm.sampler, []

    def counting_sampler(*args, **kw):
        """The script's sampler; `calls` logs the batches asked for, and the 7th dies."""
        batches = sampler(*args, **kw)

        def batch(i):
            calls.append(i)
            if len(calls) == 7 and die:  # the draft's step 3 (the target took batches 1..3)
                raise Died
            return batches(i)

        return batch

    monkeypatch.setattr(train_code_lm, "sampler", counting_sampler)
    die = True
    with pytest.raises(Died):
        train_code_lm.main(args)
    assert calls[:1] == [1], calls  # the target resumed after the stopped run's step
    assert (killed / "target").is_dir() and (killed / "training/draft/checkpoints/3").is_dir()
    die, calls[:] = False, []
    train_code_lm.main(args)
    assert calls[:1] == [3], calls  # the target loaded, the draft resumed after its step 3
    assert not (killed / "training/draft/checkpoints").exists()

    def metrics(run, stage):  # each step's, but its wall seconds
        lines = (run / "training" / stage / "metrics.jsonl").read_text().splitlines()
        timed = ("seconds", "compile_seconds")
        return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]

    for stage in ("target", "draft"):  # one line a step, as the uninterrupted run's
        assert [step["step"] for step in metrics(killed, stage)] == [0, 1, 2, 3]
        assert metrics(killed, stage) == metrics(whole, stage), stage

    load = lambda run: jax.tree.leaves(hf_eagle3.load(run / "draft")[0])
    for a, b in zip(load(whole), load(killed), strict=True):
        np.testing.assert_array_equal(a, b)

    # the run as `bench_rollout --trained --check-greedy` reads it: float32 models, held-out prompts
    bench = bench_args(whole)
    target, draft, prompts = bench_rollout.trained(bench, dtype="float32")
    params = lambda model: jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {w.dtype for w in params(target) + params(draft)} == {np.dtype("float32")}
    assert prompts.shape == (2, 16) and prompts.max() < 512
    # target/ is a whole checkpoint for RL (rl.policy=RUN_DIR): weights, tokenizer, its end token
    policy = hf.model_directory(whole)
    tokenizer = tokenizers.load(None, None, policy)
    assert policy == whole / "target" and tokenizer.eos_id == tokenizer.vocab_size - 1 == 511


def test_an_mtp_head_is_trained_and_ships_beside_the_target(tmp_path):
    """--draft-kind mtp: the draft stage trains an MTP head on the frozen target, and mtp/ is the
    target again with its head in MiMo's layout: a policy RL and serving engines load whole."""
    train_code_lm.main([*ARGS, "--draft-kind", "mtp", "--run-dir", str(tmp_path)])
    shipped, target = hf.load(tmp_path / "mtp"), hf.load(tmp_path / "target")
    np.testing.assert_array_equal(shipped.embed[...], target.embed[...])
    bench = bench_args(tmp_path)
    _, head, _ = bench_rollout.trained(bench, dtype="float32")  # the rollout benchmark reads it
    assert head.features == "final" and not (tmp_path / "draft").exists()
    assert hf.read_json(tmp_path / "mtp" / hf.CONFIG)[hf_mtp.COUNT] == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert 0 <= report["draft_top1_agreement"] <= 1
    # Another draft on this run's finished target, with a flag of the model forgotten: refused
    # before anything is read or trained (it would load the target into another model's shape).
    again = [*ARGS[:3], "model.num_layers=4", *ARGS[3:], "--draft-kind", "block"]
    with pytest.raises(hf.CheckpointError, match=r"model.num_layers=4 \(the checkpoint's 8\)"):
        train_code_lm.main([*again, "--run-dir", str(tmp_path)])
    assert not (tmp_path / "block").exists()
    with pytest.raises(ConfigError, match=r"tokenizer of 512 ids, not model.vocab_size=256"):
        code_corpus.train_tokenizer(["x"], 256, tmp_path / "tokenizer.json")
    files = code_corpus.python_files(None, 1_000_000)  # what the run read: the default --roots
    code_corpus.check_corpus(files, tmp_path / "corpus.json")
    with pytest.raises(ConfigError, match=r"not the one this run began with \(\d+ files"):
        code_corpus.check_corpus(files[1:], tmp_path / "corpus.json")


def test_an_mtp_head_trained_with_the_target_ships_from_the_first_step(tmp_path):
    """--mtp-weight: the head trains with the target from its first step (target/ holds both);
    the mtp stage goes on from that head, here for no step, so mtp/ ships it as it is."""
    joint = ["--draft-kind", "mtp", "--mtp-weight", "0.2", "--draft-steps", "0"]
    train_code_lm.main([*ARGS, *joint, "--run-dir", str(tmp_path)])
    target = hf.load(tmp_path / "target")
    params = lambda head: jax.tree.leaves(nnx.state(head, nnx.Param))
    trained = params(hf_mtp.load(tmp_path / "target", target.config))
    shipped = params(hf_mtp.load(tmp_path / "mtp", target.config))
    fresh = params(create_mtp(MTPConfig.for_target(target.config)))  # the head it started from
    for a, b in zip(trained, shipped, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, fresh, strict=True))
    with pytest.raises(ConfigError, match=r"--mtp-weight=0.2 .* --draft-kind eagle3"):
        train_code_lm.main([*ARGS, "--mtp-weight", "0.2", "--run-dir", str(tmp_path / "x")])


def test_a_block_draft_is_trained_and_saved_in_dflashs_layout(tmp_path):
    """--draft-kind block-chained: the draft stage trains a block draft with the chained head on
    the frozen target and writes block-chained/ in DFlash's layout, which RL reads as
    rollout.draft.path and the rollout benchmark with its default trees (the layout's round trip
    is tests/test_block.py's). The run directory already holds an EAGLE-3 draft of the same
    target: both stay, report.json says the steps, seconds and agreement of each, and the
    benchmark runs either (`--draft-kind`; by default the latest). The block draft trains for a
    time (`--draft-minutes`), here less than one step takes: it stops after its first step past
    the compiling one."""
    train_code_lm.main([*ARGS, "--run-dir", str(tmp_path)])
    block = ["--draft-kind", "block-chained", "--draft-minutes", "1e-4"]
    train_code_lm.main([*ARGS, *block, "--run-dir", str(tmp_path)])
    target = hf.load(tmp_path / "target")
    config = DraftConfig(kind="block", path=str(tmp_path / "block-chained"))
    draft_factory.check_config(config, target.config)
    loaded = draft_factory.from_config(config, target).config
    assert loaded.block_size == 8 and loaded.chained
    argv = ["--trained", str(tmp_path), "--temperature", "1", "--prompt-len", "16"]
    bench = bench_rollout.parse_args(argv)
    assert bench.trees == list(bench_rollout.DEFAULT_TREES[True])
    _, draft, _ = bench_rollout.trained(bench, dtype="float32")  # the rollout benchmark reads it
    assert isinstance(draft, BlockDraft) and draft.config.chained
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(report["drafts"]) == ["block-chained", "eagle3"]
    agreement = report["drafts"]["block-chained"]["draft_top1_agreement"]
    assert agreement == report["draft_top1_agreement"]
    steps = {kind: d["draft_steps"] for kind, d in report["drafts"].items()}
    assert steps == {"eagle3": 4, "block-chained": 2}
    assert all(d["draft_seconds"] > 0 for d in report["drafts"].values())
    eagle3 = bench_rollout.parse_args([*argv, "--draft-kind", "eagle3"])
    assert bench_rollout.provenance(eagle3)["draft_kind"] == "eagle3"
    assert not isinstance(bench_rollout.trained(eagle3, dtype="float32")[1], BlockDraft)
    with pytest.raises(ConfigError, match=r"--draft-kind mtp: .* holds eagle3, block-chained"):
        bench_rollout.provenance(bench_rollout.parse_args([*argv, "--draft-kind", "mtp"]))


def test_a_batch_that_does_not_split_over_the_devices_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--data-parallel=3 .* --batch=2"):
        train_code_lm.main([*ARGS, "--data-parallel", "3", "--run-dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing read or written before the error


@pytest.mark.parametrize(
    "flag, value",
    [("--steps", "-1"), ("--draft-steps", "-1"), ("--batch", "0"), ("--seq-len", "1")]
    + [("--heldout", "1"), ("--learning-rate", "nan"), ("--save-minutes", "-2")],
)
def test_a_number_out_of_range_is_refused_by_its_flag(flag, value, capsys):
    """A step count of -1 once trained nothing and saved the stage as finished; the sizes of 0
    failed inside tracing: now argparse names the flag (exit status 2) before anything runs."""
    with pytest.raises(SystemExit) as stop:
        train_code_lm.parse_args([*ARGS, "--run-dir", "x", flag, value])
    assert stop.value.code == 2
    assert f"argument {flag}: {value} must be a finite number >=" in capsys.readouterr().err


def test_rows_longer_than_the_model_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--seq-len=4096 is longer than the model's max_seq_len"):
        train_code_lm.main([*ARGS, "--seq-len", "4096", "--run-dir", str(tmp_path)])


def test_a_stage_checkpoint_heals_is_checked_against_the_flags_and_stops(tmp_path, capsys):
    """A stage's checkpoints are train_rl's: one that does not restore is moved to corrupt/ with a
    line; a resume with another --steps (its schedule) is refused unless --allow-config-change;
    at --stop-after-steps the step is saved and the run exits 75 with a line."""
    model = config_lib.load("tiny", ["model.vocab_size=512"]).model

    def loop(*flags):
        args = train_code_lm.parse_args([*ARGS, *flags, "--run-dir", str(tmp_path)])
        target = train_code_lm.stages(args, model, None, tmp_path)[0]
        return train_code_lm.stage_loop(
            tmp_path, args, model, target, trainer.Limits.from_args(args)
        )

    state = {"w": jnp.arange(4.0)}
    with loop() as first:
        first.save(2, state)
    stage = tmp_path / "training" / "target"
    shutil.rmtree(stage / "checkpoints" / "2" / "state")
    with loop() as second, pytest.raises(ConfigError, match="none of the 1 checkpoints"):
        second.resume(lambda: state)
    assert "target: checkpoint step 2 does not restore" in capsys.readouterr().out
    assert (stage / "corrupt" / "2").is_dir()
    with loop() as third:
        assert third.resume(lambda: state) is None
        third.save(2, state)
    with pytest.raises(ConfigError, match=r"flags.steps: 4 -> 5; with a changed value"):
        loop("--steps", "5")
    flags = ("--steps", "5", "--allow-config-change", "--stop-after-steps", "1")
    with pytest.raises(SystemExit) as stop, trainer.resumable(print), loop(*flags) as allowed:
        restored, done = allowed.resume(lambda: state)
        assert done == 2 and np.array_equal(restored["w"], state["w"])
        allowed.step_done(3, restored, {"loss": jnp.float32(1.5)})
    out = capsys.readouterr().out
    assert "resuming with a changed config: flags.steps: 4 -> 5" in out
    assert stop.value.code == trainer.EXIT_RESUME
    assert "target: stopped at the step limit (--stop-after-steps 1) after step 3, saved in" in out
    assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == ["3"]
    assert json.loads((stage / "metrics.jsonl").read_text()) == {"step": 2, "loss": 1.5}
