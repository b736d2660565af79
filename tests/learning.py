"""Whether the RL demo loop (tests/helpers.py's `loop`) learns, measured on its GRPO updates.

At test size the mean reward barely moves in a few dozen steps and its step-to-step noise is as
large as any rise, so a test of the reward passes or fails by the seed. Each update's direction is
another matter: it raises the log-probability of the completions that beat their group's mean
reward and lowers that of the others, by hundredths to tenths of a nat, and a run of one seed is
the same every time, so the check below is deterministic, with its margin measured over seeds
(`MARGIN`).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LOOP, loop

from jspec import config as config_lib
from jspec import tokenizers
from jspec.jobs import rl_run
from jspec.models import create
from jspec.rl import tasks
from jspec.rl.packing import PackedBatch
from jspec.rl.state import Networks

# Nats, of the mean change of log-probability of a step's completions rewarded above their group's
# mean (rising) and of those below it (falling). Seeds 0 to 5, 6 steps each, synchronous and at
# lag 1: every step's rise >= 0.016 and fall >= 0.025, most of both 0.03 to 0.24. Without the
# policy gradient both are 0.0 (the weight decay alone is below float32's resolution).
MARGIN = 0.005


class Update(NamedTuple):
    """One GRPO step of the loop: the trainer's policy parameters around it, its batch, and the
    problems of its prompts (each answered by a group of consecutive completions)."""

    before: dict
    batch: PackedBatch
    after: dict
    problems: list[tasks.Problem]


def recorded_loop(run_dir, cache, *overrides) -> tuple[list[dict], list[Update]]:
    """`loop`'s metrics and every GRPO step it took, as host arrays."""
    cfg = config_lib.load("demo", [*LOOP, *overrides])
    updates = []
    real = rl_run.make_train_step

    def recording(*args, objective="grpo", **kwargs):
        step = real(*args, objective=objective, **kwargs)
        if objective != "grpo":
            return step

        def run(state, batch):
            # read before the step, which donates the state
            n, before = jax.device_get((state.step, (state.params["policy"], batch)))
            state, metrics = step(state, batch)
            problems = tasks.problems(cfg.rl.task, int(n), cfg.rl.prompts, cfg.seed)
            updates.append(Update(*before, jax.device_get(state.params["policy"]), problems))
            return state, metrics

        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rl_run, "make_train_step", recording)
        rows = loop(run_dir, cache, *overrides)
    return rows, updates


@functools.cache
def _next_token_logprobs():
    """A jitted `(policy params, batch) -> log p(token j + 1)` at j, at the sampling temperature,
    written here rather than taken from the loss (`grpo.token_logprobs`), so a loss that reads
    the wrong log-probabilities moves other tokens than these."""
    cfg = config_lib.load("demo", LOOP)
    nets, _ = Networks.split(create(cfg.model), None, None)

    @jax.jit
    def logprobs(params, batch):
        policy, _ = nets.models({"policy": params})
        logits = policy(batch.tokens, batch.segment_ids, batch.positions)[:, :-1]
        picked = jax.nn.log_softmax(logits / cfg.rollout.temperature)
        return jnp.take_along_axis(picked, batch.tokens[:, 1:, None], -1)[..., 0]

    return logprobs


def assert_updates_follow_rewards(updates: list[Update]) -> None:
    """In every update, the completions rewarded above their group's mean rise in log-probability
    (summed over their tokens) by more than MARGIN on average, and those below it fall by more
    than MARGIN. Rewards and log-probabilities are both computed here from the batch's tokens, so
    advantages of the wrong sign or sequence fail as well as a loss of the wrong log-probabilities
    or without the policy gradient."""
    logprobs, tokenizer = _next_token_logprobs(), tokenizers.ByteTokenizer()
    for n, (before, batch, after, problems) in enumerate(updates):
        generated = batch.response[:, 1:]  # token j + 1 was sampled: its log-prob is at j
        seq, tokens = batch.sequence[:, 1:][generated], batch.tokens[:, 1:][generated]
        texts = [tokenizer.decode(tokens[seq == i]) for i in range(batch.sequence.max() + 1)]
        group = len(texts) // len(problems)  # completions per prompt, consecutive
        reward = np.array([tasks.reward(problems[i // group], t) for i, t in enumerate(texts)])
        reward = reward.reshape(len(problems), group)
        change = np.asarray(logprobs(after, batch) - logprobs(before, batch))[generated]
        change = np.bincount(seq, change, len(texts)).reshape(reward.shape)
        mean = reward.mean(axis=1, keepdims=True)
        rise, fall = change[reward > mean].mean(), change[reward < mean].mean()
        assert rise > MARGIN and fall < -MARGIN, (n, rise, fall)
