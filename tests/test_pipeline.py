"""The pipelined policy (`jspec.pipeline`) computes what the unpipelined one does: loss and every
gradient for 2 and 4 stages, 1 to 4 microbatches, GPipe and circular, mixed with data or context
parallelism; the tap channel delivers each tap of each microbatch from the stage that made it; the
co-training step's losses and gradients are unchanged; the schedule's collective-permutes are the
same with taps on and off; rollouts still run on it; bad pipeline configs are named.

Compilation dominates on the CPU: each case compiles once (cached) and serves several tests.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    COMPARED,
    chained_block,
    close,
    close_trees,
    collective_lines,
    loop,
    random_rollouts,
)

from jspec import mesh as mesh_lib
from jspec.config import (
    ConfigError,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    RLConfig,
    RolloutConfig,
)
from jspec.models import create
from jspec.models.block import BlockConfig, create_block
from jspec.models.draft import Eagle3Config, create_eagle3
from jspec.pipeline import PipelinedTransformer, Schedule, TapChannel, from_stages
from jspec.pipeline import create as create_pipelined
from jspec.pipeline import schedule as sched
from jspec.rl import packing
from jspec.rl.state import Networks
from jspec.rl.train import make_loss

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_seq_len=128,
    remat="none",
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 16)), jnp.int32)


def make_mesh(stages: int, data: int = 1, context: int = 1):
    devices = jax.devices()[: stages * data * context]
    return mesh_lib.make_mesh(MeshConfig(data=data, stage=stages, context=context), devices)


def layer_order(grads: dict, schedule: Schedule) -> dict:
    """Gradients of a pipelined policy with the stage weights back in layer order."""
    layers = jax.tree.map(lambda g: from_stages(g, schedule), grads["layers"])
    return {**grads, "layers": layers}


def loss_fn(graphdef, rest, taps: bool):
    """Mean squared logits, and the taps (detached) when asked: (loss, taps)."""

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(TOKENS, features="taps" if taps else None)
        logits, tapped = out if taps else (out, None)
        return jnp.mean(logits**2), jax.lax.stop_gradient(tapped)

    return loss


@functools.cache
def run(stages=0, microbatches=1, repeats=1, data=1, context=1, taps=True):
    """(loss, grads in layer order, taps, compiled HLO text) of the policy, pipelined over
    `stages` (0: not pipelined)."""
    if stages:
        pipeline = PipelineConfig(stages=stages, microbatches=microbatches, repeats=repeats)
        mesh = make_mesh(stages, data, context)
        model = create_pipelined(MODEL, pipeline, mesh=mesh, seed=0)
    else:
        model = create(MODEL, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = jax.jit(jax.value_and_grad(loss_fn(graphdef, rest, taps), has_aux=True))
    compiled = step.lower(params).compile()
    (loss, tapped), grads = compiled(params)
    grads = nnx.to_pure_dict(grads)
    if stages:
        grads = layer_order(grads, model.schedule)
    return jax.device_get((loss, grads, tapped)) + (compiled.as_text(),)


CASES = [  # stages, microbatches, repeats, data, context: together every value of each
    (2, 2, 1, 2, 1),
    (4, 4, 2, 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "S{}-M{}-R{}-data{}-context{}".format(*c))
def test_pipelined_loss_gradients_and_taps_equal_unpipelined(case):
    loss, grads, taps, _ = run(*case)
    want_loss, want_grads, want_taps, _ = run()
    close(loss, want_loss)
    close_trees(grads, want_grads)
    # The taps are copies of hidden states that two programs computed, rounded differently: within
    # a few float32 ulps of their scale (a wrong layer or stage would be off by order one).
    close(taps, want_taps, rtol=2e-6)


def test_tap_channel_delivers_each_microbatch_from_its_stage_exactly():
    """A toy stage (x -> x + layer + 1, exact in float32) through the real schedule and channel:
    every delivered tap is exactly the state entering its layer, for its own microbatch."""
    schedule = Schedule(stages=4, microbatches=4, repeats=2, layers_per_chunk=1)
    mesh, taps = make_mesh(4, data=2), (1, 4, 6)
    channel = TapChannel(taps, schedule)
    x_M = jnp.arange(4 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 3) * 100

    def stage_fn(w, x, mb, repeat, stage):
        slots, first = channel.empty_slots(x), schedule.chunk_start(repeat, stage)
        slots = channel.record(slots, x, stage, first)
        return x + w[repeat, 0] + 1, slots

    weights = jnp.asarray(sched.to_stages(jnp.arange(8.0)[:, None], schedule))
    out, delivered = jax.jit(
        lambda w, x: sched.run(stage_fn, w, x, x, schedule, mesh, ("batch", None), channel)
    )(weights, x_M)
    np.testing.assert_array_equal(out, x_M + sum(range(1, 9)))
    for j, t in enumerate(taps):
        np.testing.assert_array_equal(delivered[j], x_M + sum(range(1, t + 1)))


def test_pipeline_collective_permutes_are_the_same_with_taps_on_and_off():
    """Taps leave by an all-gather over the stage axis; the schedule's permutes are untouched."""
    on, off = run(*CASES[0], taps=True)[3], run(*CASES[0], taps=False)[3]
    assert collective_lines(on, "collective-permute") == collective_lines(off, "collective-permute")
    assert collective_lines(on, "collective-permute")
    assert len(collective_lines(on, "all-gather")) > len(collective_lines(off, "all-gather"))


# ---------------------------------------------------------------------------------------------
# The co-training train step on a pipelined policy.

RL = RLConfig(prompts=2, group_size=4, sequences_per_row=2, ttt_steps=0, loss_chunk=16)
ROLLOUT = RolloutConfig(temperature=0.7, eos_id=1)


DRAFTS = {  # drafts that read the taps, which cross the stages on the TapChannel
    "eagle3": lambda mesh: create_eagle3(Eagle3Config.for_target(MODEL, 48), mesh=mesh, seed=1),
    "block": lambda mesh: create_block(BlockConfig.for_target(MODEL, 4), mesh=mesh, seed=1),
    "chained block": lambda mesh: chained_block(MODEL, 4, mesh=mesh),
}


@functools.cache
def cotrain_loss_and_gradients(stages: int, kind: str):
    """Policy and draft losses and gradients of the co-training loss (`jspec.rl.train.make_loss`,
    unchanged) with the policy pipelined over `stages` (0: not pipelined, one device), the draft
    of `kind`."""
    mesh = make_mesh(stages) if stages else None
    if stages:
        pipeline = PipelineConfig(stages=stages, microbatches=2)
        policy = create_pipelined(MODEL, pipeline, mesh=mesh, seed=0)
    else:
        policy = create(MODEL, seed=0)
    nets, params = Networks.split(policy, DRAFTS[kind](mesh), mesh)
    batch = packing.pack(*random_rollouts(8, 6, 7, MODEL.vocab_size), per_row=2, align=2)
    batch = jax.tree.map(jnp.asarray, batch)
    loss = make_loss(nets, RL, ROLLOUT, num_sequences=8)
    grads, metrics = jax.jit(jax.grad(loss, has_aux=True))(params, {}, None, batch)
    if stages:
        grads["policy"] = layer_order(grads["policy"], policy.schedule)
    return jax.device_get((grads, metrics["draft_loss"], metrics["policy_loss"]))


@pytest.mark.parametrize("kind", DRAFTS)
def test_cotraining_step_on_a_pipelined_policy_equals_unpipelined(kind):
    (g1, d1, p1) = cotrain_loss_and_gradients(0, kind)
    (gp, dp, pp) = cotrain_loss_and_gradients(2, kind)
    close(dp, d1)
    close(pp, p1)
    close_trees(gp, g1)


def test_rollout_layers_of_a_pipelined_policy_are_the_unpipelined_ones():
    """The sampler's unrolled layers read the stage weights back in layer order, inside `jit`."""
    pipelined = create_pipelined(MODEL, PipelineConfig(stages=2), mesh=make_mesh(2, data=2))
    plain = create(MODEL, seed=0)
    _, got = nnx.jit(lambda m: m._stacks()["layers"])(pipelined)
    _, want = plain._stacks()["layers"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "pipeline, mesh, message",
    [
        (PipelineConfig(stages=3), MeshConfig(stage=3), "not divisible by pipeline.stages"),
        (PipelineConfig(stages=2, repeats=2), MeshConfig(stage=2), "microbatches=1 < "),
        (PipelineConfig(stages=2), MeshConfig(stage=4), "set mesh.stage=2"),
        (PipelineConfig(stages=0), MeshConfig(), "pipeline.stages=0 must be >= 1"),
    ],
)
def test_bad_pipeline_configs_are_named_before_anything_is_built(pipeline, mesh, message):
    with pytest.raises(ConfigError, match=message):
        pipeline.validate(MODEL, mesh)


def test_microbatches_that_do_not_cut_the_batch_are_named_before_compiling():
    pipeline, mesh = PipelineConfig(stages=2, microbatches=3), make_mesh(2)
    make = lambda: PipelinedTransformer(MODEL, pipeline, rngs=nnx.Rngs(0), mesh=mesh)
    model = nnx.eval_shape(make)
    with pytest.raises(ConfigError, match="pipeline.microbatches=3"):
        nnx.eval_shape(lambda m: m(TOKENS), model)


@pytest.mark.slow
def test_rl_demo_on_a_pipelined_policy_equals_unpipelined(tmp_path, compilation_cache):
    """The demo loop (warm start, rollouts, co-training steps) with `pipeline.stages=2` over a
    stage x data mesh gives the metrics of the same loop unpipelined."""
    short = ("model.num_layers=4", "rl.steps=2", "rl.sft_steps=4")
    plain = loop(tmp_path / "plain", compilation_cache, *short)
    piped = loop(
        tmp_path / "piped",
        compilation_cache,
        *short,
        "mesh.stage=2",
        "pipeline.stages=2",
        "pipeline.microbatches=2",
    )
    for a, b in zip(plain, piped, strict=True):
        for key in COMPARED:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5, err_msg=key)
