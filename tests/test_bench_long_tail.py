"""`jspec.bench.long_tail` at test size: every variant of an RL step's rollout runs (plain and
speculative, with and without buckets, and partial rollouts that carry rows into the next
step), one rollout program each, and the table's JSON says so."""

import itertools
import json

import numpy as np
import pytest
from helpers import LOOP

from jspec import config as config_lib
from jspec.bench import long_tail
from jspec.jobs import rl_run


def test_every_variant_runs_and_compiles_one_program(tmp_path):
    overrides = [*LOOP, "rl.prompts=16", "rl.group_size=4", "rollout.max_new_tokens=16"]
    overrides.append("rollout.buckets=[{rows: 32}]")
    out = tmp_path / "long_tail.json"
    args = ["--config", "demo", "--steps", "2", "--partial-rows", "8", "--out", str(out)]
    long_tail.main([*args, *overrides])
    report = json.loads(out.read_text())
    names = [r["variant"] for r in report["rows"]]
    assert names == [
        "speculative",
        "speculative + buckets",
        "plain",
        "plain + buckets",
        "speculative + buckets, partial 8",
    ]
    assert report["programs"] >= len(names)
    by_name = {r["variant"]: r for r in report["rows"]}
    assert by_name["speculative"]["speedup_over_speculative"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["iterations"] >= 1 for r in report["rows"])
    # Each stage's verify steps add up to the variant's: one stage without buckets, two with
    # (partial rollouts: their sum alone).
    for r in report["rows"]:
        stages = 2 if r["variant"] in ("speculative + buckets", "plain + buckets") else 1
        assert len(r["iterations_by_stage"]) == stages
        assert abs(sum(r["iterations_by_stage"]) - r["iterations"]) < 1e-9
    # Tokens a row emits a step: at most 1 decoding plainly, each stage's within the tree's
    # bound; the share of verify steps whose accepted path reached each depth cannot grow with it.
    for r in report["rows"]:
        bound = 1 if r["variant"].startswith("plain") else 1 + len(r["reached_depth"])
        assert 0 < r["tokens_per_row_step"] <= bound
        assert all(0 <= x <= bound for x in r["tokens_per_row_step_by_stage"])
        assert all(0 <= b <= a <= 1 for a, b in itertools.pairwise(r["reached_depth"]))


def test_answer_lengths_give_every_variant_the_worked_answers_lengths(tmp_path):
    """With --answer-lengths each response runs exactly as long as its problem's worked answer
    (capped at rollout.max_new_tokens), whatever the policy: every variant emits the same tokens."""
    overrides = [*LOOP, "rl.prompts=16", "rl.group_size=4", "rollout.max_new_tokens=16"]
    overrides += ["rl.task.spread=4", "rollout.buckets=[{rows: 32}]"]
    out = tmp_path / "long_tail.json"
    args = ["--config", "demo", "--steps", "1", "--answer-lengths", "--out", str(out)]
    long_tail.main([*args, *overrides])
    rows = json.loads(out.read_text())["rows"]
    assert len({r["mean_length"] for r in rows}) == 1
    run = rl_run.Run(rl_run.check(config_lib.load("demo", overrides), "frozen", 8), "frozen")
    budgets = np.concatenate([np.asarray(b) for _, _, b in long_tail.batches(run, 1, True)[1:]])
    assert rows[0]["mean_length"] == budgets.mean() and budgets.min() < budgets.max()


def test_answer_lengths_with_same_length_is_refused():
    with pytest.raises(config_lib.ConfigError, match="--answer-lengths sets every response"):
        args = ["--config", "demo", "--answer-lengths", "--same-length"]
        long_tail.main([*args, "rollout.buckets=[{rows: 32}]"])
