"""The co-training train step: the draft loss and every gradient are the same under context
parallelism (zigzag ring, packed rows) as on one rank; the draft adds only its own dot operations
(the policy runs once); and the demo loop's GRPO steps raise the completions rewarded above their
group's mean and lower those below, the loop resumes after a kill step for step, and refuses a
checkpoint of another model or a corrupt one, losing nothing.

Compilation dominates on the CPU: shapes are tiny, the TTT has one branch pass in the mesh test.
"""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    COMPARED,
    LOOP,
    chained_block,
    close,
    close_trees,
    count_dots,
    loop,
    random_rollouts,
)
from learning import assert_updates_follow_rewards, recorded_loop

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec import tokenizers
from jspec.config import (
    ConfigError,
    MeshConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    TreeConfig,
)
from jspec.jobs import rl_run, train_rl
from jspec.models import create, hf, hf_block, hf_mtp
from jspec.models.block import BlockConfig, create_block
from jspec.models.draft import Eagle3Config, Shared, create_eagle3
from jspec.models.mtp import MTPConfig, create_mtp
from jspec.rl import packing
from jspec.rl.draft_loss import draft_loss, draft_passes
from jspec.rl.state import Networks, init_state, optimizer, trained_groups
from jspec.rl.train import make_loss, make_train_step

MODEL = ModelConfig(  # 4 heads, 2 of keys and values: the defaults
    vocab_size=64, hidden_size=32, num_layers=3, head_dim=8, intermediate_size=64, max_seq_len=128
)
RL = RLConfig(prompts=2, group_size=4, sequences_per_row=4, ttt_steps=1, loss_chunk=16)
ROLLOUT = RolloutConfig(temperature=0.7, eos_id=1)


def packed(align: int) -> packing.PackedBatch:
    """8 random rollouts packed 4 to a row (2 rows), every document aligned to `align`."""
    batch = packing.pack(*random_rollouts(8, 6, 7, MODEL.vocab_size), per_row=4, align=align)
    return jax.tree.map(jnp.asarray, batch)


DRAFTS = {  # the co-trained draft kinds, for MODEL
    "eagle3": lambda mesh: create_eagle3(Eagle3Config.for_target(MODEL, 48), mesh=mesh, seed=1),
    "mtp": lambda mesh: create_mtp(MTPConfig.for_target(MODEL), mesh=mesh, seed=1),
    "block": lambda mesh: create_block(BlockConfig.for_target(MODEL, 4), mesh=mesh, seed=1),
    "chained block": lambda mesh: chained_block(MODEL, 4, mesh=mesh),
}


def networks(mesh, draft: str | None = "eagle3"):
    policy = create(MODEL, mesh=mesh, seed=0)
    return Networks.split(policy, draft and DRAFTS[draft](mesh), mesh)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])  # the block draft's: tests/test_block.py
def test_training_time_test_passes_are_the_draft_at_inference(kind):
    """Pass i's hidden state at t is the draft's at depth i of a chain rooted after token t + 1,
    and pass 0's logits are the root's: the branch K/V, anchors, parents, positions and input
    shifts of the TTT match inference, in the rollout copy (products fused, weights cast once)."""
    target, draft = create(MODEL, seed=0), DRAFTS[kind](None)
    tokens = jnp.asarray(random_rollouts(1, 12, 1, MODEL.vocab_size)[0])
    _, features = target(tokens, features=draft.features)
    shared = Shared.of(target)
    seg, pos = jnp.ones_like(tokens), jnp.arange(12)[None]
    passes = jax.jit(draft_passes, static_argnums=6)(draft, shared, features, tokens, seg, pos, 2)
    t, rollout = 5, draft.for_rollout()
    root = jax.jit(rollout.prefill)(
        shared,
        tokens[:, : t + 1],
        jnp.array([t + 1]),
        tokens[:, t + 1],
        features[:, :, : t + 1],
        rollout.init_cache(1, 16),
    )
    close(root.hidden[0], passes[0][0, t], rtol=1e-4)
    logits = draft.from_target_vocab(root.logits)  # -inf outside the draft vocabulary
    close(logits[0], draft.draft_logits(passes[0], shared)[0, t], rtol=1e-4)
    tree, hidden, parent = rollout.empty_tree(1, 2), root.hidden[:, None], jnp.array([[-1]])
    for depth in (1, 2):
        token = tokens[:, t + 1 + depth][:, None]
        _, hidden, k, v, anchor = jax.jit(rollout.tree_step, static_argnums=3)(
            shared, token, hidden, depth, parent, root.cache, tree
        )
        tree, parent = tree.add(k, v, anchor, parent, depth - 1), jnp.array([[depth - 1]])
        close(hidden[0, 0], passes[depth][0, t], rtol=1e-4)


@functools.cache
def loss_and_gradients(context: int, kind: str = "eagle3", tensor: int = 1, vocab_chunks: int = 1):
    """Policy and draft losses and gradients of one packed batch on a mesh with `context` ranks
    (and data=2), documents aligned for cp = 4 so every mesh reads the same rows."""
    axes = MeshConfig(data=2, context=context, tensor=tensor)
    mesh = mesh_lib.make_mesh(axes, jax.devices()[: 2 * context * tensor])
    nets, params = networks(mesh, kind)
    rl = dataclasses.replace(RL, vocab_chunks=vocab_chunks)
    loss = make_loss(nets, rl, ROLLOUT, num_sequences=8)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    grads, metrics = jax.jit(jax.grad(loss, has_aux=True))(
        params, {}, None, jax.device_put(packed(align=8), rows)
    )
    return jax.device_get((grads, metrics["draft_loss"], metrics["policy_loss"]))


@pytest.mark.parametrize(
    "cp, kind",
    [
        (2, "eagle3"),
        (2, "mtp"),
        (2, "block"),
        (4, "block"),
        (2, "chained block"),
        pytest.param(4, "eagle3", marks=pytest.mark.slow),
    ],
)
def test_context_parallel_draft_loss_and_gradients_equal_one_rank(cp, kind):
    (g1, d1, p1), (gc, dc, pc) = loss_and_gradients(1, kind), loss_and_gradients(cp, kind)
    close(dc, d1)
    close(pc, p1)
    close_trees(gc, g1)


def test_the_policy_head_over_vocabulary_slices_gives_the_whole_heads_losses_and_gradients():
    """rl.vocab_chunks: the policy's log-probabilities with the head over 4 slices of the
    vocabulary, split over tensor=2 and context=2, give one rank's losses and gradients (the
    draft's teacher reads the policy's hidden states either way)."""
    (g1, d1, p1), (gc, dc, pc) = loss_and_gradients(1), loss_and_gradients(2, "eagle3", 2, 4)
    close(dc, d1)
    close(pc, p1)
    close_trees(gc, g1)


def test_optimizer_moments_are_placed_as_their_parameters():
    """Adam's moments of a parameter split over the mesh are split the same way, not replicated
    (a plain jit of the optimizer's init leaves them on one device)."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    nets, params = networks(mesh)
    trained = trained_groups("cotrain", True)
    state = init_state(nets, params, optimizer(RL, trained, 1e-3), trained, seed=0, reference=False)
    split = [x for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated]
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert split and len(moments) == 2 * len(jax.tree.leaves(state.params))
    for param in split:
        twins = [m for m in moments if m.shape == param.shape and m.sharding == param.sharding]
        assert len(twins) >= 2, (param.shape, param.sharding)


@pytest.mark.parametrize("warmup", [0, 4])
def test_policy_and_draft_learning_rates_warm_up_over_warmup_steps(warmup):
    """With rl.warmup_steps the first update of a fresh optimizer moves no weight and step k's
    moves each by k / warmup_steps of the learning rate (Adam's normalised step is about 1 a
    weight under a constant gradient); without, every step moves by the full rate."""
    rl = dataclasses.replace(RL, warmup_steps=warmup, draft_learning_rate=2e-3)
    tx = optimizer(rl, ("policy", "draft"), 1e-3)
    params = {"policy": {"w": jnp.ones(3)}, "draft": {"w": jnp.ones(3)}}
    grads = jax.tree.map(lambda x: 0.01 * x, params)  # under both clipping norms
    state = tx.init(params)
    for k in range(6):
        updates, state = tx.update(grads, state, params)
        share = min(k / warmup, 1.0) if warmup else 1.0
        for group, rate in (("policy", 1e-3), ("draft", 2e-3)):
            moved = -np.asarray(updates[group]["w"]) / rate  # weight decay: 1e-4 of a weight
            np.testing.assert_allclose(moved, share, atol=2e-3 * share + 1e-6)


@pytest.mark.parametrize("kind", DRAFTS)
def test_draft_adds_only_its_own_dot_operations(kind):
    """dots(step with draft) = dots(step without) + dots(draft loss and its gradient): the draft
    (an EAGLE-3 draft on the taps, an MTP head on the final hidden state) reads the policy's one
    forward and never runs the trunk again."""
    batch = packed(align=2)
    rl = dataclasses.replace(RL, ttt_steps=2)

    def step_dots(draft: str | None):
        nets, params = networks(None, draft)
        trained = trained_groups("cotrain", draft is not None)
        tx = optimizer(rl, trained, 1e-3)
        state = init_state(nets, params, tx, trained, seed=0, reference=False)
        step = make_train_step(nets, tx, trained, rl, ROLLOUT, num_sequences=8)
        return count_dots(jax.make_jaxpr(step)(state, batch)), nets, params

    without, _, _ = step_dots(None)
    with_draft, nets, params = step_dots(kind)
    policy, draft = nets.models(params)
    hidden, taps = jax.eval_shape(lambda: policy(*batch[:3], features=draft.features, head=False))

    def own(draft_params, shared, taps, hidden):
        draft = nets.draft.merge(draft_params)
        rows = (batch.tokens, batch.segment_ids, batch.positions, batch.response)
        ttt = dict(steps=rl.ttt_steps, decay=rl.ttt_decay, temperature=ROLLOUT.temperature)
        return draft_loss(draft, shared, taps, hidden, *rows, **ttt, chunk=rl.loss_chunk).loss

    jaxpr = jax.make_jaxpr(jax.grad(own))(params["draft"], Shared.of(policy), taps, hidden)
    draft_dots = count_dots(jaxpr)
    assert draft_dots > 0 and without > 0
    assert with_draft == without + draft_dots, (with_draft, without, draft_dots)


# ---------------------------------------------------------------------------------------------
# The demo loop (jspec/jobs/train_rl.py) at test size.


@pytest.fixture(scope="module")
def cache(compilation_cache):
    """The session's persistent compilation cache (conftest): a resumed run compiles nothing."""
    return compilation_cache


def test_grpo_steps_raise_the_better_completions_and_lower_the_worse(tmp_path, cache):
    """From a policy warm-started to succeed sometimes (about 1 in 7), each GRPO step raises the
    completions that beat their group and lowers the others (tests/learning.py: the reward itself
    is too noisy at this size to show learning in a test's steps)."""
    _, updates = recorded_loop(tmp_path, cache, "rl.steps=3", "rl.sft_steps=60")
    assert_updates_follow_rewards(updates)


def test_an_mtp_head_co_trains_and_ships_with_the_policy(tmp_path, cache):
    """rollout.draft.kind=mtp: the warm start teaches a fresh head (whose top-1 agreement with
    the policy is about 1 in the 512 ids of the vocabulary) to agree often, RL keeps it agreeing,
    and the export carries it beside the policy, in MiMo's layout."""
    metrics = loop(tmp_path, cache, "rl.steps=6", "rl.sft_steps=40", "rollout.draft.kind=mtp")
    agreement = [m["agreement"] for m in metrics]
    assert agreement[0] > 0.1, agreement
    assert np.mean(agreement[-3:]) >= agreement[0], agreement
    assert all(m["accepted_length"] > 1.2 for m in metrics), metrics
    policy = tmp_path / "export" / "policy"
    head = hf_mtp.load(policy, hf.load(policy).config)
    assert head.features == "final"


def test_a_block_draft_co_trains_in_the_loop(tmp_path, cache):
    """rollout.draft.kind=block: the warm start teaches a fresh block draft (whose top-1
    agreement is about 1 in the 512 ids) to agree often, RL keeps it agreeing, its chains are
    accepted beyond the first token, and the export carries it in DFlash's layout."""
    extra = ("rl.steps=4", "rl.sft_steps=40", "rollout.draft.kind=block")
    metrics = loop(tmp_path, cache, *extra, "rollout.draft.block_size=5")
    agreement = [m["agreement"] for m in metrics]
    assert agreement[0] > 0.1 and np.mean(agreement[-2:]) >= 0.5 * agreement[0], agreement
    assert all(m["accepted_length"] > 1.2 for m in metrics), metrics
    export = tmp_path / "export"
    draft = hf_block.load(export / "draft", hf.load(export / "policy").config)
    assert draft.config.block_size == 5


def test_kill_and_resume_equals_uninterrupted_step_for_step(tmp_path, cache, capsys):
    short = ("rl.steps=4", "rl.sft_steps=10")
    full = loop(tmp_path / "full", cache, *short)
    killed = tmp_path / "killed"
    assert loop(killed, cache, *short, "--stop-after-steps", "4") == []  # in the warm start
    stopped = "warm start: stopped at the step limit (--stop-after-steps 4) after step 4, saved in "
    assert stopped in capsys.readouterr().err
    assert (killed / "warm_start" / "checkpoints" / "4").is_dir()
    loop(killed, cache, *short, "--stop-after-steps", "9")  # the warm start's 6 left and 3 steps
    stopped = "stopped at the step limit (--stop-after-steps 9) after step 3, saved in "
    assert stopped in capsys.readouterr().err
    assert not (killed / "warm_start" / "checkpoints").exists()  # its end is step 0
    ckpts = killed / "checkpoints"
    # Killed during the async save of step 4: a partial directory orbax never committed. And the
    # latest committed checkpoint (3) corrupt: its arrays are gone.
    shutil.copytree(ckpts / "3" / "config", ckpts / "4.orbax-checkpoint-tmp-1" / "config")
    shutil.rmtree(ckpts / "3" / "state" / "ocdbt.process_0")
    resumed = loop(killed, cache, *short)
    assert "checkpoint step 3" in capsys.readouterr().err  # reported, the one before used
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(full, resumed, strict=True):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, a["step"]

    before = sorted(p.name for p in ckpts.iterdir())
    with pytest.raises(ConfigError, match=r"another model or draft \(model.head_dim: 8 -> 16"):
        loop(killed, cache, *short, "model.hidden_size=64", "model.head_dim=16")
    assert sorted(p.name for p in ckpts.iterdir()) == before  # nothing lost


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rl.prompts=3", "rl.group_size=3", "rl.sequences_per_row=1"],
            r"rl.prompts \* rl.group_size = 3 \* 3 = 9 does not split over the 8 rollout shards",
        ),
        (["rl.task.name=algebra"], r"rl.task.name='algebra' is not a task; use one of"),
        (["rollout.max_new_tokens=3"], r"rollout.max_new_tokens=3 cannot hold the task's worked"),
        (["rl.tree_costs=nowhere.json"], r"rl.tree_costs='nowhere.json' is not a file"),
        (["rl.partial_rows=8"], r"rl.partial_rows=8 must be in \[0, 8\) \(fewer than"),
        (
            ["rl.prompts=16", "rl.group_size=4", "rl.partial_rows=8", "rollout.rows=8"],
            r"rl.partial_rows=8 leaves that many rows running, so rollout.rows=8 must be more",
        ),
        (
            ["rl.prompts=16", "rl.group_size=4", "rl.partial_rows=4"],
            r"rl.partial_rows=4: the carried completions .* over the 8 rollout shards",
        ),
    ],
)
def test_bad_run_input_is_named_before_anything_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        args = [*LOOP, "rl.steps=1", "rl.sft_steps=1", *overrides, "--run-dir", str(tmp_path)]
        train_rl.main([*args, "--compilation-cache", "", "--quiet"])
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("cost, tree", [(1.0, "chain 4"), (9.0, "plain")])
def test_each_rollout_batch_verifies_the_tree_that_pays(tmp_path, cache, cost, tree):
    """rl.tree_costs: the rollouts verify the chain where its measured cost pays for its accepted
    length, and decode plainly (no draft: accepted length 1) where it does not."""
    chain = TreeConfig(kind="chain", depth=4)  # the demo's own tree: its programs are compiled
    row = lambda b: {
        "batch": b,
        "speculative": {"chain 4": {"step_in_decode_steps": cost, "accepted_length": 2.0}},
    }
    costs = tmp_path / "costs.json"
    costs.write_text(
        json.dumps(
            {
                "args": {"temperature": 1.0},  # the demo's
                "trees": {"chain 4": dataclasses.asdict(chain)},
                "rows": [row(1), row(256)],
            }
        )
    )
    rows = loop(tmp_path / "run", cache, "rl.steps=2", "rl.sft_steps=5", f"rl.tree_costs={costs}")
    assert [r["tree"] for r in rows] == [tree, tree]
    learnt = json.loads((tmp_path / "run" / "trees" / "2.json").read_text())  # beside the save
    assert learnt["estimate"]["chain 4"] != 2.0 or learnt["plain"] != 1.0
    assert rows[0]["rollout_programs"] == rows[1]["rollout_programs"]  # compiled once
    if tree == "plain":
        assert all(r["accepted_length"] == 1.0 for r in rows)


def test_each_stage_of_a_rollout_verifies_the_tree_that_pays_at_its_rows(tmp_path, cache):
    """rl.tree_costs with rollout.buckets: the 8 rows a device decodes verify the tree that pays
    at 8 rows (a chain of 2: a chain of 4 costs 4 plain steps there), the bucket of a row a
    device the one that pays at 1 row (a chain of 4, as cheap as a chain of 2 there)."""
    chains = {"chain 2": (1.0, 1.0, 1.5), "chain 4": (1.0, 9.0, 2.0)}  # costs at 1, 256; accepted
    step = lambda t, i: {"step_in_decode_steps": chains[t][i], "accepted_length": chains[t][2]}
    rows = [
        {"batch": b, "speculative": {t: step(t, i) for t in chains}} for i, b in [(0, 1), (1, 256)]
    ]
    trees = {t: dataclasses.asdict(TreeConfig(kind="chain", depth=int(t[-1]))) for t in chains}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"args": {"temperature": 1.0}, "trees": trees, "rows": rows}))
    extra = (
        "rl.steps=2",
        "rl.sft_steps=5",
        f"rl.tree_costs={costs}",
        "rollout.buckets=[{rows: 8}]",
    )
    metrics = loop(tmp_path / "run", cache, *extra)
    assert [r["tree"] for r in metrics] == ["chain 2 > chain 4"] * 2


def test_rows_packed_by_real_lengths_give_the_full_layouts_losses_and_gradients():
    """rl.packed_rows: 8 rollouts whose responses end early, packed into 1 row by their real
    lengths instead of 2 at full length, give the same losses and gradients; sequences that do
    not fit are refused (the run then takes the full layout)."""
    prompts, p_len, responses, r_len, logprobs, advantages = random_rollouts(8, 6, 7, 64)
    p_len, r_len = np.minimum(p_len, 4), np.minimum(r_len, 2)  # 8 of at most 6: one row of 56
    arrays = (prompts, p_len, responses, r_len, logprobs, advantages)
    full = packing.pack(*arrays, per_row=4, align=2)
    dense = packing.pack(*arrays, per_row=4, align=2, rows=1)
    assert full.tokens.shape == (2, 56) and dense.tokens.shape == (1, 56)
    assert sorted(np.unique(dense.sequence[dense.sequence >= 0])) == list(range(8))
    assert packing.pack(*arrays[:3], np.full(8, 7), *arrays[4:], per_row=4, align=2, rows=1) is None

    nets, params = networks(None)
    loss = jax.jit(jax.grad(make_loss(nets, RL, ROLLOUT, num_sequences=8), has_aux=True))
    got, want = (loss(params, {}, None, jax.tree.map(jnp.asarray, b)) for b in (dense, full))
    for key in ("policy_loss", "draft_loss", "agreement"):
        close(got[1][key], want[1][key])
    close_trees(got[0], want[0])


@pytest.mark.parametrize("draft_rows", [2, 1])
def test_the_draft_trains_on_draft_rows_spread_over_each_data_shard(draft_rows):
    """rl.draft_rows=2 of 4 rows over 2 data shards (or 1, rounded up to a row a shard): the
    draft's loss and gradients are those of rows 0 and 2 alone (one per shard), the policy's
    those of the whole batch."""
    batch = packing.pack(*random_rollouts(16, 6, 7, MODEL.vocab_size), per_row=4, align=2)
    mesh = mesh_lib.make_mesh(MeshConfig(data=2), jax.devices()[:2])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def run(rl, batch, mesh):
        nets, params = networks(mesh)
        loss = make_loss(nets, rl, ROLLOUT, num_sequences=16)
        batch = jax.tree.map(jnp.asarray, batch)
        batch = batch if mesh is None else jax.device_put(batch, rows)
        return jax.device_get(jax.jit(jax.grad(loss, has_aux=True))(params, {}, None, batch))

    got = run(dataclasses.replace(RL, prompts=4, draft_rows=draft_rows), batch, mesh)
    whole = run(dataclasses.replace(RL, prompts=4), batch, None)
    subset = run(dataclasses.replace(RL, prompts=4), jax.tree.map(lambda x: x[::2], batch), None)
    close(got[1]["policy_loss"], whole[1]["policy_loss"])
    close_trees(got[0]["policy"], whole[0]["policy"])
    close(got[1]["draft_loss"], subset[1]["draft_loss"])
    close_trees(got[0]["draft"], subset[0]["draft"])
    assert not np.allclose(got[1]["draft_loss"], whole[1]["draft_loss"])


def test_a_step_takes_the_fewest_packed_rows_that_hold_its_sequences():
    """rl.packed_rows=[16, 8] (in any order), 64 sequences in rows of 32 tokens (2 of a 10-token
    prompt and 6 new tokens): documents of 4 tokens fit 8 rows, of 8 tokens 16, full-length ones
    neither, so they take the full layout's 32."""
    cfg = config_lib.load("demo", [*LOOP, "rl.packed_rows=[16,8]"])
    run = rl_run.Run((cfg, tokenizers.ByteTokenizer(), 10), "none")
    prompts, _, responses, _, logprobs, advantages = random_rollouts(64, 10, 6, 64)
    for prompt, response, rows in [(2, 1, 8), (2, 5, 16), (10, 6, 32)]:
        lengths = np.full(64, prompt), np.full(64, response)
        packed, count = run.pack(prompts, lengths[0], responses, lengths[1], logprobs, advantages)
        assert count == rows and packed.tokens.shape == (rows, 32)
        placed = np.bincount(packed.sequence[packed.response], minlength=64)
        assert (placed == response).all()  # every response token, once
    # On more data shards each count rounds up to a multiple of them: the rows split over them.
    counts = dataclasses.replace(RL, prompts=32, packed_rows=(10, 12, 14, 16))
    assert [counts.row_counts(n) for n in (1, 4, 8)] == [[10, 12, 14, 16], [12, 16], [16]]


def test_a_step_whose_sequences_do_not_fit_the_packed_rows_takes_the_full_layout(tmp_path, cache):
    """The demo's sequences are nearly all of full length: 8 packed rows cannot hold them, so
    each step takes the 32 rows of the full layout, and the run is the run without packed rows."""
    short = ("rl.steps=2", "rl.sft_steps=5")
    full = loop(tmp_path / "full", cache, *short)
    packed = loop(tmp_path / "packed", cache, *short, "rl.packed_rows=8")
    assert [r["packed_rows"] for r in packed] == [32, 32]
    for a, b in zip(full, packed, strict=True):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
