"""The process-wide cache of compiled train steps (`jspec.rl.train.make_train_step`): runs of one
config share one program, traced once, and runs that differ in what the step reads (the
optimizer's hyperparameters, a loss coefficient) get programs of their own, with the results of
uncached runs. The draft's vocabulary map is an argument of the program: runs of other maps share
it and still train on their own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_rollouts

from jspec.config import ModelConfig, RLConfig, RolloutConfig
from jspec.models import create
from jspec.models.draft import Eagle3Config, create_eagle3
from jspec.rl import packing
from jspec.rl import train as train_lib
from jspec.rl.state import Networks, init_state, optimizer

MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=3, head_dim=8, intermediate_size=64, max_seq_len=128
)
RL = RLConfig(prompts=2, group_size=4, sequences_per_row=4, ttt_steps=0, loss_chunk=16)
ROLLOUT = RolloutConfig(temperature=0.7, eos_id=1)


@pytest.fixture
def traces(monkeypatch):
    """Counts the train step's traces (each builds its loss once), from an empty cache."""
    count, real = [0], train_lib.make_loss

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(train_lib, "make_loss", counting)
    train_lib.clear_cache()
    yield count
    train_lib.clear_cache()


def run(rl=RL, learning_rate=1e-3, target_ids=None):
    """The parameters and metrics after two steps of a fresh run on one packed batch: of the
    policy alone, or co-training an EAGLE-3 draft of vocabulary map `target_ids`."""
    policy, draft = create(MODEL, seed=0), None
    if target_ids is not None:
        draft = create_eagle3(Eagle3Config.for_target(MODEL, 48), seed=1, target_ids=target_ids)
    nets, params = Networks.split(policy, draft, None)
    trained = tuple(params)
    tx = optimizer(rl, trained, learning_rate)
    state = init_state(nets, params, tx, trained, seed=0, reference=False)
    step = train_lib.make_train_step(nets, tx, trained, rl, ROLLOUT, num_sequences=8)
    batch = packing.pack(*random_rollouts(8, 6, 7, MODEL.vocab_size), per_row=4, align=2)
    for _ in range(2):
        state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
    return jax.device_get((state.params, metrics))


def same(a, b) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_runs_of_one_config_share_one_traced_program(traces):
    """Equal hyperparameters give one optimizer object; a second run, and one that differs only
    in fields the step never reads (how long it runs, how often it saves), trace nothing again."""
    assert optimizer(RL, ("policy",), 1e-3) is optimizer(dataclasses.replace(RL), ("policy",), 1e-3)
    first = run()
    assert traces[0] == 1
    assert same(run(), first)
    assert same(run(dataclasses.replace(RL, steps=7, save_every=3)), first)
    assert traces[0] == 1


@pytest.mark.parametrize(
    "base, changed, programs",
    [
        ({}, dict(learning_rate=3e-3), 2),  # the optimizer's
        ({}, dict(rl=dataclasses.replace(RL, clip_epsilon=0.05)), 2),  # read by the loss
        (dict(target_ids=np.arange(48)), dict(target_ids=np.arange(16, 64)), 1),  # an argument
    ],
    ids=["learning rate", "clip epsilon", "vocabulary map"],
)
def test_runs_that_differ_in_what_the_step_reads_get_their_own_results(
    traces, base, changed, programs
):
    """After a run of a base config, a run of another gives what it gives in a fresh process (an
    empty cache), not the base's: through a program of its own, or the base's with the draft's
    other vocabulary map as its argument."""
    first = run(**base)
    got = run(**changed)
    assert traces[0] == programs
    train_lib.clear_cache()
    assert same(got, run(**changed))
    assert not same(got, first)
