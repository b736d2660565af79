"""Partial rollouts (`rl.partial_rows`, jspec.rl.partial): the pool trains groups whole, carries
their unfinished completions on as prefixes with the budget left, records each token's policy
version, and survives a checkpoint; in the loop every step leaves at most K rows running, trains
whole groups only, and a run stopped and resumed equals the uninterrupted one step for step.
"""

import numpy as np
import pytest
from helpers import COMPARED, loop

from jspec.config import ConfigError
from jspec.rl import partial

# A step's figures that partial rollouts add, compared between a run and its resumed twin.
PARTIAL = ("carried_rows", "trained_groups", "token_lag")


def rollout(rows):
    """Host outputs of a rollout, one (tokens, finished) per row, max_new_tokens=4."""
    tokens = np.full((len(rows), 4), -1, np.int32)
    for i, (row, _) in enumerate(rows):
        tokens[i, : len(row)] = row
    lengths = np.asarray([len(row) for row, _ in rows], np.int32)
    logprobs = np.where(tokens >= 0, -0.5, 0.0).astype(np.float32)
    return tokens, lengths, logprobs, np.asarray([done for _, done in rows])


def test_a_pool_trains_groups_whole_and_carries_their_unfinished_completions(tmp_path):
    pool = partial.Pool(rows=2, prompt_width=3, max_new_tokens=4, group_size=2)
    prompts, lengths = np.array([[5, 6, 0], [5, 6, 0], [7, 0, 0], [7, 0, 0]]), [2, 2, 1, 1]
    idle = pool.continued()  # nothing carried yet: two rows of one token that end at once
    assert idle.lengths.tolist() == [1, 1] and idle.budgets.tolist() == [1, 1]
    first = [([1, 2], True), ([3], False), ([4, 4, 1], True), ([9], False)] + [([0], True)] * 2
    step0 = pool.add(0, 0, ["a", "a", "b", "b"], prompts, lengths, rollout(first))
    assert step0.problems == [], "every group of step 0 has a completion running"

    carried = pool.continued()
    assert carried.tokens[:, :3].tolist() == [[5, 6, 3], [7, 9, 0]]
    assert carried.lengths.tolist() == [3, 2] and carried.budgets.tolist() == [3, 3]
    (tmp_path / "1.pkl").write_bytes(pool.snapshot())
    then = [([1], True)] * 4 + [([8, 1], True), ([2], False)]  # 4 fresh, then the 2 carried
    step1 = pool.add(1, 1, ["c", "c", "d", "d"], prompts, lengths, rollout(then))
    # Group a (step 0) and both groups of step 1 are whole; group b waits for its second answer.
    assert step1.problems == ["a", "a", "c", "c", "d", "d"] and step1.steps == [0, 0, 1, 1, 1, 1]
    assert step1.tokens[1, :3].tolist() == [3, 8, 1] and step1.lengths[:2].tolist() == [2, 3]
    assert step1.versions[1, :4].tolist() == [0, 1, 1, -1]
    assert step1.prompts[0].tolist() == [5, 6, 0] and step1.prompt_lengths.tolist()[:3] == [2, 2, 2]
    figures = partial.metrics(step1, np.array([True] * 5 + [False]), 1, group_size=2)
    assert figures == {"carried_rows": 1, "trained_groups": 3, "token_lag": pytest.approx(3 / 9)}
    left = pool.continued()
    assert left.tokens[0, :3].tolist() == [7, 9, 2] and left.budgets.tolist() == [2, 1]

    resumed = partial.Pool(rows=2, prompt_width=3, max_new_tokens=4, group_size=2)
    assert resumed.resume(tmp_path / "1.pkl") and not resumed.resume(tmp_path / "2.pkl")
    assert resumed.continued().tokens.tolist() == carried.tokens.tolist()
    fewer = partial.Pool(rows=1, prompt_width=3, max_new_tokens=4, group_size=2)
    with pytest.raises(ConfigError, match=r"carries 2 completions of up to 1 tokens on, which"):
        fewer.resume(tmp_path / "1.pkl")


# ---------------------------------------------------------------------------------------------
# In the loop: tests/helpers.py's LOOP as 16 prompts x 4 responses of up to 16 tokens (of 6, most
# run to the end), 8 rows (one a rollout shard) left running.


SHORT = ("rl.steps=4", "rl.sft_steps=10", "rl.prompts=16", "rl.group_size=4")
SHORT += ("rollout.max_new_tokens=16", "rl.partial_rows=8")


@pytest.fixture(scope="module")
def cache(compilation_cache):
    return compilation_cache


def test_partial_rollouts_train_whole_groups_and_resume_step_for_step(tmp_path, cache):
    full = loop(tmp_path / "full", cache, *SHORT)
    assert all(m["carried_rows"] <= 8 for m in full)
    assert any(m["carried_rows"] for m in full), "no rollout left a row running"
    assert any(m["token_lag"] > 0 for m in full), "no carried token trained a step later"
    assert all(8 <= m["trained_groups"] <= 24 for m in full), [m["trained_groups"] for m in full]
    loop(tmp_path / "killed", cache, *SHORT, "--stop-after-steps", "12")  # 10 warm-start steps
    assert sorted(p.name for p in (tmp_path / "killed" / "partial").iterdir()) == ["1.pkl", "2.pkl"]
    resumed = loop(tmp_path / "killed", cache, *SHORT)
    for a, b in zip(full, resumed, strict=True):
        assert {k: a[k] for k in (*COMPARED, *PARTIAL)} == {
            k: b[k] for k in (*COMPARED, *PARTIAL)
        }, a["step"]


def test_partial_rollouts_run_ahead_asynchronously(tmp_path, cache):
    """At lag 1 on split meshes the next step's rollout starts before this step's completions
    are known to the trainer: the sampler's thread carries them on."""
    split = ("rl.rollout_mesh.data=4", "rl.max_lag=1")
    metrics = loop(tmp_path, cache, *SHORT, *split)
    assert [m["lag"] for m in metrics] == [0, 1, 1, 1]
    assert any(m["carried_rows"] for m in metrics) and any(m["token_lag"] > 1 for m in metrics)
