"""Asynchronous RL (jspec.jobs.train_rl with rl.rollout_mesh and rl.max_lag): on 8 devices split
4 / 4, lag 0 is the synchronous run step for step; lag 1 is reproducible from its seed, keeps
every batch within one step of the trainer, feeds the ratio the log-probabilities of the weights
that generated each batch, and its GRPO steps still raise the completions rewarded above their
group's mean and lower those below; the weights move device to device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPARED, LOOP, close, loop, train_rl
from jax.sharding import NamedSharding, PartitionSpec
from learning import assert_updates_follow_rewards, recorded_loop

from jspec import config as config_lib
from jspec.config import ConfigError, MeshConfig
from jspec.models import create
from jspec.rl import grpo
from jspec.rl.meshes import split_meshes
from jspec.rl.state import Networks
from jspec.rl.weights import WeightMover

DISCRETE = ("reward", "accepted_length")
SPLIT = ("rl.rollout_mesh.data=4",)  # 4 rollout devices, the training mesh on the other 4
SHORT = ("rl.steps=3", "rl.sft_steps=10")
# Lag 1, from a policy warm-started to succeed sometimes (about 1 in 7).
LAG_1 = ("rl.steps=6", "rl.sft_steps=60", *SPLIT, "rl.max_lag=1")


@pytest.fixture(scope="module")
def cache(compilation_cache):
    """The session's persistent compilation cache (conftest): a resumed run compiles nothing."""
    return compilation_cache


def test_lag_0_on_split_meshes_equals_the_synchronous_run(tmp_path, cache):
    synchronous = loop(tmp_path / "sync", cache, *SHORT)
    split = loop(tmp_path / "split", cache, *SHORT, *SPLIT, "rl.max_lag=0")
    assert [r["lag"] for r in split] == [0, 0, 0]
    assert all(r["transfer_time"] > 0 for r in split)
    for a, b in zip(synchronous, split, strict=True):
        # the same rollouts and rewards; losses up to float rounding (the two meshes split the
        # rows differently, so XLA multiplies blocks of other shapes)
        assert {k: a[k] for k in DISCRETE} == {k: b[k] for k in DISCRETE}, a["step"]
        for k in set(COMPARED) - set(DISCRETE):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=f"{k} at step {a['step']}")


@pytest.fixture(scope="module")
def lag_1(tmp_path_factory, cache):
    """A lag-1 run's metrics and its GRPO steps (`learning.Update`), as host arrays."""
    return recorded_loop(tmp_path_factory.mktemp("lag_1"), cache, *LAG_1)


def test_grpo_steps_at_lag_1_raise_the_better_completions_and_lower_the_worse(lag_1):
    """Trained on rollouts of the weights one step old, through the ratio to their
    log-probabilities, each step still moves the policy the way the rewards point."""
    assert_updates_follow_rewards(lag_1[1])


def test_ratio_uses_the_log_probabilities_of_the_weights_that_generated_the_batch(lag_1):
    """Every batch is at most one step behind (the first, generated before any step, none); its
    recorded log-probabilities are those of the policy of step n - lag recomputed from scratch,
    and not those of the trainer's weights at step n."""
    rows, seen = lag_1
    assert [r["lag"] for r in rows] == [0] + [1] * (len(rows) - 1)
    cfg = config_lib.load("demo", LOOP)
    nets, _ = Networks.split(create(cfg.model), None, None)

    def logprobs(params, batch):
        policy, _ = nets.models({"policy": params})
        hidden = policy(*batch[:3], head=False)
        return grpo.token_logprobs(hidden, policy.head[...], batch.tokens, cfg.rollout.temperature)

    for n in (1, 2, len(rows) - 1):
        batch = jax.tree.map(jnp.asarray, seen[n].batch)
        mask = np.asarray(batch.response)
        generating = np.asarray(logprobs(seen[n - rows[n]["lag"]].before, batch))[mask]
        trainer = np.asarray(logprobs(seen[n].before, batch))[mask]
        recorded = np.asarray(batch.old_logprobs)[mask]
        close(recorded, generating, rtol=1e-4)
        assert np.abs(trainer - recorded).max() > 10 * np.abs(generating - recorded).max(), n


def test_lag_1_is_reproducible_from_its_seed_and_resumes(tmp_path, cache, lag_1):
    """A second run of the same seed draws the same steps; stopped and resumed, it refills the
    pipeline from the checkpoint (the resumed step's batch from its own weights, lag 0)."""
    again = loop(tmp_path, cache, *LAG_1, "--stop-after-steps", "63")  # 60 warm-start steps
    for a, b in zip(lag_1[0], again, strict=False):
        assert {k: a[k] for k in (*COMPARED, "lag")} == {k: b[k] for k in (*COMPARED, "lag")}
    resumed = loop(tmp_path, cache, *LAG_1, "--stop-after-steps", "2")
    assert [(r["step"], r["lag"]) for r in resumed] == [(0, 0), (1, 1), (2, 1), (3, 0), (4, 1)]


@pytest.mark.parametrize(
    "src, dst",
    [
        (MeshConfig(data=2, tensor=2), MeshConfig(data=4)),  # gathered on the trainer, then copied
        (MeshConfig(data=-1, tensor=2), MeshConfig(data=1, tensor=2)),  # 6 training, 2 rollout
        (MeshConfig(data=1, tensor=2), MeshConfig(data=3, tensor=2)),  # 2 training, 6 rollout
        (MeshConfig(data=-1), MeshConfig(data=1, tensor=4)),  # split again on the rollout side
    ],
)
def test_weights_move_device_to_device(src, dst):
    """The move between the meshes never reads an array back to the host (the transfer guard
    would refuse the host's copy back), while a plain `device_put` between mismatched layouts
    does."""
    train, rollout = split_meshes(src, dst)
    spec = PartitionSpec("tensor", None)
    x = jnp.arange(64.0 * 8).reshape(64, 8)
    tree = {"w": jax.device_put(x, NamedSharding(train, spec))}
    move = WeightMover({"w": NamedSharding(train, spec)}, {"w": NamedSharding(rollout, spec)})
    move(tree)  # compiled outside the guard: compiling may upload constants
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        moved = jax.block_until_ready(move(tree))
        with pytest.raises(Exception, match="Disallowed host-to-device"):
            jax.device_put(tree["w"], NamedSharding(rollout, PartitionSpec(None, "tensor")))
    assert moved["w"].sharding == NamedSharding(rollout, spec)
    np.testing.assert_array_equal(moved["w"], x)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.max_lag=-1"], r"rl.max_lag=-1 must be >= 0: 0 is synchronous"),
        (["rl.max_lag=1"], r"rl.max_lag=1 needs rl.rollout_mesh: rollouts run ahead"),
        (["rl.rollout_mesh.data=-1"], r"rl.rollout_mesh.data=-1: the rollout mesh takes a fixed"),
        (["rl.rollout_mesh.data=8"], r"takes 8 devices, but only 8 are present, leaving none"),
        (["rl.rollout_mesh.data=3"], r"training mesh's 5 devices and rl.rollout_mesh's 3: one"),
        (
            [*SPLIT, "mesh.data=2"],
            r"needs 2 devices but 4 are present.*the 4 devices left after rl.rollout_mesh's 4",
        ),
        (
            [*SPLIT, "rl.prompts=3", "rl.group_size=3", "rl.sequences_per_row=1"],
            r"9 does not split over the 4 rollout shards \(rl.rollout_mesh.data \* rl.rollout_",
        ),
    ],
)
def test_bad_split_is_named_before_anything_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        args = [*LOOP, "rl.steps=1", "rl.sft_steps=1", *overrides, "--run-dir", str(tmp_path)]
        train_rl.main([*args, "--compilation-cache", "", "--quiet"])
    assert not (tmp_path / "checkpoints").exists()
