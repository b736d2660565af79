"""GRPO advantages and losses against hand computations; packing; tasks and their rewards; RL
config errors that name the value and the fix."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_rollouts

from jspec import config, tokenizers
from jspec.config import ConfigError, RLConfig, TaskConfig
from jspec.rl import grpo, packing, tasks


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    got = np.asarray(grpo.group_advantages(rewards, group_size=4, eps=0.0 + 1e-6))
    # group 1: mean 0.5, std 0.5 -> +-1; group 2: all equal -> 0
    np.testing.assert_allclose(got, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)


def test_policy_loss_by_hand_token_and_sequence_normalisation():
    logp = jnp.log(jnp.array([[0.5, 0.5, 0.9, 0.2]]))
    old = jnp.log(jnp.array([[0.5, 0.25, 0.9, 0.4]]))  # ratios 1, 2, 1, 0.5
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    mask = jnp.array([[True, True, True, True]])
    seq = jnp.array([[0, 0, 1, 1]])
    # eps 0.2: token losses -min(r A, clip(r) A) = -1, -1.2, 1, 0.8 (clip 0.5 -> 0.8, A=-1: max)
    per_token = np.array([-1.0, -1.2, 1.0, 0.8])
    kw = dict(num_sequences=2, clip_epsilon=0.2)
    loss, metrics = grpo.policy_loss(logp, old, adv, mask, seq, normalization="token", **kw)
    np.testing.assert_allclose(loss, per_token.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction"], 0.5, rtol=1e-6)
    # sequence level: a 1-token sequence weighs as much as a 3-token one
    seq = jnp.array([[0, 0, 0, 1]])
    loss, _ = grpo.policy_loss(logp, old, adv, mask, seq, normalization="sequence", **kw)
    np.testing.assert_allclose(loss, (per_token[:3].mean() + per_token[3]) / 2, rtol=1e-6)


def test_kl_penalty_is_k3_and_masked():
    logp = jnp.log(jnp.array([[0.5, 0.5]]))
    ref = jnp.log(jnp.array([[0.25, 0.9]]))
    mask = jnp.array([[True, False]])
    zero = jnp.zeros((1, 2))
    loss, metrics = grpo.policy_loss(
        logp,
        logp,
        zero,
        mask,
        jnp.zeros((1, 2), jnp.int32),
        num_sequences=1,
        clip_epsilon=0.2,
        ref_logprobs=ref,
        kl_coef=0.5,
    )
    d = np.log(0.25) - np.log(0.5)
    np.testing.assert_allclose(metrics["kl"], np.exp(d) - d - 1, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.5 * (np.exp(d) - d - 1), rtol=1e-6)


def test_token_logprobs_shift_and_temperature():
    logits = jnp.log(jnp.array([[[0.1, 0.9], [0.6, 0.4], [0.5, 0.5]]]))
    tokens, identity = jnp.array([[0, 1, 0]]), jnp.eye(2)  # a head that reads logits as they are
    got = grpo.token_logprobs(logits, identity, tokens, temperature=1.0)
    np.testing.assert_allclose(got, np.log([[1.0, 0.9, 0.6]]), rtol=1e-6)
    hot = grpo.token_logprobs(logits, identity, tokens, temperature=2.0, chunks=2)
    p = np.sqrt([0.1, 0.9]) / np.sqrt([0.1, 0.9]).sum()
    np.testing.assert_allclose(hot[0, 1], np.log(p[1]), rtol=1e-6)


def test_pack_lays_documents_end_to_end_aligned():
    prompts, pl, resp, rl, lp, adv = random_rollouts(4, 5, 6, vocab=50)
    b = packing.pack(prompts, pl, resp, rl, lp, adv, per_row=2, align=4)
    assert b.tokens.shape == (2, packing.row_length(11, 2, 4))
    for i in range(4):
        r, doc = divmod(i, 2)
        where = b.sequence[r] == i
        assert where.sum() % 4 == 0 and (b.segment_ids[r][where] == doc + 1).all()
        n = pl[i] + rl[i]
        got = b.tokens[r][where][:n]
        np.testing.assert_array_equal(got, np.concatenate([prompts[i, : pl[i]], resp[i, : rl[i]]]))
        np.testing.assert_array_equal(b.positions[r][where], np.arange(where.sum()))
        assert b.response[r][where].sum() == rl[i] and not b.response[r][where][: pl[i]].any()
        np.testing.assert_allclose(b.old_logprobs[r][b.response[r] & where], lp[i, : rl[i]])
    assert (b.segment_ids[b.sequence < 0] == 0).all()


def test_tasks_reward_exactly_and_shift():
    cfg = TaskConfig(name="addition", difficulty=2, shift_step=5, shifted_difficulty=3)
    before, after = tasks.problems(cfg, 4, 3, seed=0), tasks.problems(cfg, 5, 3, seed=0)
    assert all(len(p.prompt) == 6 for p in before) and all(len(p.prompt) == 8 for p in after)
    p = before[0]
    a, b = map(int, p.prompt[:-1].split("+"))
    assert p.final == str(a + b) and tasks.reward(p, p.answer) == 1.0
    assert tasks.reward(p, "junk;" + str(a + b)) == 1.0 and tasks.reward(p, p.answer + "1") == 0.0
    for name, task in tasks.TASKS.items():
        batch = tasks.problems(TaskConfig(name=name, difficulty=3), 0, 4, seed=1)
        assert list(task.score(batch, [q.answer for q in batch])) == [1.0] * 4, name
    tok = tokenizers.ByteTokenizer()
    assert tok.decode(tok.encode("12+3=") + [tok.eos_id, 65]) == "12+3="


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.group_size=1"], r"rl.group_size=1: group-relative advantages need at least 2"),
        (["rl.sequences_per_row=3"], r"rl.sequences_per_row=3 does not divide the batch"),
        (["rl.normalization=batch"], r"rl.normalization='batch' is not one of 'token'"),
    ],
)
def test_bad_rl_config_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load("demo", overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.task.name=multiplication"], r"rl.task.name='multiplication' is not a task; use"),
        (
            ["rl.task.shift_step=5", "rl.task.shifted_name=sortin"],
            r"rl.task.shifted_name='sortin' .* Did you mean 'sorting'",
        ),
    ],
)
def test_unknown_tasks_are_named_by_the_task_list(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tasks.check_tasks(config.load("demo", overrides).rl.task)


def test_rollouts_grpo_cannot_learn_from_are_named():
    cfg = config.load("demo", ["rollout.temperature=0"])  # loads: greedy decoding elsewhere
    with pytest.raises(ConfigError, match=r"GRPO needs sampled rollouts"):
        cfg.rl.check_rollout(cfg.rollout)


def test_batch_that_does_not_split_over_the_mesh_is_named():
    rl = RLConfig(prompts=3, group_size=2, sequences_per_row=2)
    with pytest.raises(ConfigError, match=r"= 6 does not split over the 4 rollout shards"):
        rl.check_mesh({"data": 2, "context": 2})
    with pytest.raises(ConfigError, match=r"packed training rows .* do not split over mesh.data"):
        RLConfig(prompts=4, group_size=2, sequences_per_row=4).check_mesh({"data": 4, "context": 1})
