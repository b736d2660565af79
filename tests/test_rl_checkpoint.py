"""RL from a trained checkpoint: a Hugging Face policy (written by `transformers`) with its
tokenizer.json is loaded, trained for RL steps with a draft, exported, and the export reloads
(in jspec and in `transformers`) with the trained weights' logits; bad inputs are named before
anything is built."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import LOOP, close, loop
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jspec import config as config_lib
from jspec.bench import rl_experiment
from jspec.config import ConfigError
from jspec.jobs import rl_run, train_rl, trainer
from jspec.models import create, hf, hf_eagle3
from jspec.models.draft import Eagle3Config, create_eagle3

EOS = "<|endoftext|>"
# The policy of LOOP's model section (tests/helpers.py) as a transformers Qwen3 config.
QWEN3 = dict(
    vocab_size=512,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
    rope_theta=10_000.0,
    max_position_embeddings=1024,
)
TEXTS = ["sort 3142=1234", "sort 90817=01789", "sort 555=555", "sort 2=2"] * 4


def write_tokenizer(directory, extra_tokens: int = 0) -> Tokenizer:
    """A byte-level BPE of the task's alphabet and its tokenizer_config.json naming the end
    token, as a Hugging Face checkpoint has them; `extra_tokens` more special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS]))
    tok.add_special_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny Qwen3 written by `transformers`, with its tokenizer."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3))
    directory = tmp_path_factory.mktemp("policy")
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def overrides(policy, *extra):
    return [f"rl.policy={policy}", "rollout.eos_id=null", *extra]


SHORT = ("rl.steps=2", "rl.sft_steps=2")


def last_state(run_dir, policy):
    """(Run, the TrainState of the run's latest checkpoint), as `--export` restores it."""
    args = train_rl.parse_args([*LOOP, *overrides(policy, *SHORT), "--run-dir", str(run_dir)])
    checked = rl_run.check(config_lib.load("demo", args.overrides), "cotrain", 8)
    run = rl_run.Run(checked, "cotrain")
    limits = trainer.Limits.from_args(args)
    with train_rl.run_loop(args, checked[0], run_dir, limits, print) as tl:
        state, _ = train_rl.start_or_resume(run, tl, print)
    return run, state


def jspec_logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def test_a_hugging_face_policy_trains_by_rl_and_its_export_reloads(tmp_path, policy_dir, cache):
    rows = loop(tmp_path, cache, *overrides(policy_dir, *SHORT))
    assert [r["step"] for r in rows] == [0, 1]
    export = tmp_path / train_rl.EXPORT
    run, state = last_state(tmp_path, policy_dir)
    assert int(state.step) == 2
    policy, draft = run.networks.models(state.params)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (8, 12)), jnp.int32)
    reloaded = hf.load(export / "policy", run.mesh)  # placed as the trained one: the same program
    np.testing.assert_array_equal(jspec_logits(reloaded, tokens), jspec_logits(policy, tokens))
    # The steps moved the policy, from the checkpoint's weights
    start, now = (np.ravel(m.embed[...]) for m in (hf.load(policy_dir), policy))
    assert 0.9 < start @ now / np.linalg.norm(start) / np.linalg.norm(now) < 1
    trained = jspec_logits(policy, tokens)

    served = transformers.AutoModelForCausalLM.from_pretrained(export / "policy").eval()
    with torch.no_grad():
        want = served(torch.tensor(np.asarray(tokens))).logits.numpy()
    close(trained, want, rtol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export / "policy")
    assert tokenizer.eos_token == EOS
    assert tokenizer("sort 3142=").input_ids == run.tokenizer.encode("sort 3142=")

    again, _ = hf_eagle3.load(export / "draft", target_embedding=policy.embed[...])
    jax.tree.map(
        np.testing.assert_array_equal, nnx.state(again, nnx.Param), nnx.state(draft, nnx.Param)
    )
    np.testing.assert_array_equal(again.target_ids[...], draft.target_ids[...])


@pytest.fixture(scope="module")
def cache(compilation_cache):
    return compilation_cache


def other_draft(tmp_path):
    """An EAGLE-3 draft for a target of hidden size 64."""
    target = config_lib.load("demo", LOOP).model
    wide = create_eagle3(Eagle3Config.for_target(dataclasses.replace(target, hidden_size=64)))
    hf_eagle3.save(tmp_path / "draft", wide)
    return tmp_path / "draft"


def no_tokenizer(tmp_path, policy_dir):
    shutil.copytree(policy_dir, tmp_path / "policy")
    (tmp_path / "policy" / "tokenizer.json").unlink()
    return tmp_path / "policy"


def big_tokenizer(tmp_path, policy_dir):
    shutil.copytree(policy_dir, tmp_path / "policy")
    write_tokenizer(tmp_path / "policy", extra_tokens=600)
    return tmp_path / "policy"


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (lambda tmp, p: tmp / "nowhere", [], r"nowhere/config.json not found; point at a Hugging"),
        (no_tokenizer, [], r"the policy checkpoint .*policy has no tokenizer.json"),
        (big_tokenizer, [], r"needs model.vocab_size >= 6\d\d \(got 512\)"),
        (
            lambda tmp, p: p,
            ["model.num_layers=4"],
            r"another model than the config's: model.num_layers=4 \(the checkpoint's 3\)",
        ),
        (
            lambda tmp, p: p,
            ["model.max_seq_len=8"],
            r"plus rollout.max_new_tokens=6 exceed the model's context, model.max_seq_len=8",
        ),
        (
            lambda tmp, p: p,
            ["rollout.draft.path=DRAFT"],
            r"the EAGLE-3 draft's hidden_size=64 differs from the target's 32",
        ),
    ],
    ids=["no checkpoint", "no tokenizer", "tokenizer too big", "other model", "context", "draft"],
)
def test_bad_checkpoint_input_is_named_before_anything_is_built(
    tmp_path, policy_dir, make, extra, message
):
    extra = [e.replace("DRAFT", str(other_draft(tmp_path))) for e in extra]
    run_dir = tmp_path / "run"
    args = [*LOOP, *overrides(make(tmp_path, policy_dir), *extra), "--run-dir", str(run_dir)]
    with pytest.raises(ConfigError, match=message):
        train_rl.main([*args, "--compilation-cache", "", "--quiet"])
    assert not (run_dir / "checkpoints").exists()


def test_a_random_policy_saved_by_jspec_is_the_checkpoint_transformers_reads(tmp_path):
    """The policy a config describes, written by `hf.save`, passes `check_config` against that
    config, and fails it against another."""
    cfg = config_lib.load("demo", LOOP).model
    hf.save(tmp_path, create(cfg))
    hf.check_config(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"model.hidden_size=64 \(the checkpoint's 32\)"):
        hf.check_config(tmp_path, dataclasses.replace(cfg, hidden_size=64))


def test_the_experiment_runs_each_mode_and_tables_the_ratios(tmp_path, policy_dir, cache):
    """jspec.bench.rl_experiment: one warm start, exported; one train_rl run per mode and seed
    from that export (none warm-starts again), then the table of the ratios to the run without
    speculation, and the plot; run again, it trains nothing more; a later command's seed joins
    the table."""
    args = ["--config", "demo", "--policy", str(policy_dir), "--out", str(tmp_path)]
    args += ["--seeds", "0", "--modes", "none", "cotrain", "--compilation-cache", cache]
    args += [*LOOP, "rollout.eos_id=null", *SHORT]
    rl_experiment.main(args)
    warm = tmp_path / "warm" / train_rl.EXPORT
    assert (warm / "draft" / "config.json").is_file()
    for mode in ("none", "cotrain"):
        config = tmp_path / f"{mode}-seed0" / "checkpoints" / "2" / "config" / "metadata"
        rl = json.loads(config.read_text())["rl"]
        assert rl["policy"] == str(warm / "policy") and rl["sft_steps"] == 0
    table = json.loads((tmp_path / "summary.json").read_text())
    assert table["none"]["accepted_first"] == 1.0 and table["none"]["rollout_speedup"] == 1.0
    assert table["cotrain"]["accepted_first"] > 1.0 and table["cotrain"]["steps"] == 2
    assert table["cotrain"]["agreement_last"] is not None
    # Plain decoding trips its loop once a token after the first, for the longest response.
    assert table["none"]["verify_steps"] >= table["none"]["response_length"] - 1
    # Per stage, tokens a row emits per trip: at most 1 without speculation (idle rows count).
    stages = lambda mode: table[mode]["stage_tokens_per_trip"].split(" / ")
    assert 0 < max(float(x) for x in stages("none") if x != "-") <= 1.0
    assert len(stages("cotrain")) == len(stages("none"))
    samples = [json.loads(line) for line in (tmp_path / "none-seed0" / "samples.jsonl").open()]
    assert [s["step"] for s in samples] == [0, 0] and all(0 <= s["reward"] <= 1 for s in samples)
    assert (tmp_path / "rl_experiment.png").stat().st_size > 0
    before = (tmp_path / "cotrain-seed0" / "metrics.jsonl").read_text()
    rl_experiment.main(args)
    assert (tmp_path / "cotrain-seed0" / "metrics.jsonl").read_text() == before
    rl_experiment.main([*args, "--seeds", "1", "--modes", "none"])
    table = json.loads((tmp_path / "summary.json").read_text())
    assert table["none"]["seeds"] == 2 and table["cotrain"]["seeds"] == 1
