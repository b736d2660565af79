"""The block draft (DFlash style): its block's logits, by the rollout's forward against its cache
and by the training passes, against a reference written in plain numpy from DFlash's description;
configs and drafts it cannot serve refused by name before anything compiles; exact save / load in
DFlash's layout, and checkpoints that do not map refused by name (its sampling law and
greedy tokens: tests/test_generate.py; its co-training under context parallelism and the
pipeline: tests/test_rl.py, tests/test_pipeline.py)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import close, moved
from safetensors.numpy import load_file, save_file

from jspec.config import ConfigError, DraftConfig, ModelConfig, RolloutConfig, TreeConfig
from jspec.models import create, draft_factory, hf, hf_block
from jspec.models.block import BlockConfig, BlockDraft, create_block
from jspec.models.draft import Shared, check_target
from jspec.rl.draft_loss import block_passes
from jspec.sampler import generate
from jspec.sampler.tree_proposal import propose_block

TARGET = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_seq_len=64,
)
BLOCK = 4
T = 11


@pytest.fixture(scope="module", params=[False, True], ids=["parallel", "chained"])
def setup(request):
    """A target, a block draft of two layers (norm weights away from 1 and the chained head's
    output away from its zero start, so each is tested), a row of tokens and the target's taps."""
    target = create(TARGET, seed=0)
    config = BlockConfig.for_target(TARGET, BLOCK, num_layers=2, chained=request.param)
    draft = create_block(config, seed=1)
    graphdef, state = nnx.split(draft)
    draft = nnx.merge(graphdef, moved(state, seed=2, names=("norm", "chain_out")))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TARGET.vocab_size, (1, T)))
    _, taps = target(tokens, features="taps")
    return target, draft, tokens, taps


def reference_block_logits(target, draft, tokens, taps, t: int, fed) -> np.ndarray:
    """Logits [BLOCK - 1, V] of the block after token t, in float64 numpy, from DFlash's
    description: the context is RMSNorm(fc(taps concatenated)) at positions 0..t; the block is the
    root (token t + 1, the target's embedding) at position t + 1 and mask embeddings after it;
    each layer's queries are the block's, its keys and values the context's then the block's,
    all seen (no mask), with q/k RMSNorm and split-half RoPE; residual MLP (SwiGLU); final norm and
    the target's output head; position k predicts token t + 1 + k. The chained head (where the
    draft has one) adds chain_out(silu(chain_in([final_norm(z_{k-1}), embed(fed[k - 1])]))) to
    position k's output, z_0 the root's output."""
    f64 = lambda x: np.asarray(x, np.float64)
    c, w = TARGET, jax.tree.map(f64, nnx.to_pure_dict(nnx.state(draft)))
    eps, e = c.rms_norm_eps, c.head_dim

    def norm(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rope(x, positions):  # x [N, heads, E]
        angles = positions[:, None] * c.rope_theta ** -(np.arange(0, e, 2) / e)
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        x1, x2 = x[..., : e // 2], x[..., e // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    taps = f64(taps)[:, 0, : t + 1]  # [3, t + 1, D]
    ctx = norm(np.concatenate(list(taps), axis=-1) @ w["fc"], w["hidden_norm"])
    embed = f64(target.embed[...])
    x = np.stack([embed[int(tokens[0, t + 1])]] + [w["mask"]] * (BLOCK - 1))
    ctx_pos, block_pos = np.arange(t + 1.0), t + 1.0 + np.arange(BLOCK)
    for i in range(2):
        lw = {name: value[i] for name, value in w["layers"].items()}
        h = norm(x, lw["attn_norm"])
        q = rope(norm(np.einsum("nd,dhe->nhe", h, lw["wq"]), lw["q_norm"]), block_pos)
        both = np.concatenate([ctx, h])
        k = norm(np.einsum("nd,dke->nke", both, lw["wk"]), lw["k_norm"])
        k = rope(k, np.concatenate([ctx_pos, block_pos]))
        v = np.einsum("nd,dke->nke", both, lw["wv"])
        group = c.num_heads // c.num_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhe,khe->hqk", q, k) * e**-0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("nhe,hed->nd", np.einsum("hqk,khe->qhe", p, v), lw["wo"])
        h = norm(x, lw["mlp_norm"])
        gate = h @ lw["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lw["w_up"])) @ lw["w_down"]
    if "chain_in" in w:
        for k in range(1, BLOCK):
            u = np.concatenate([norm(x[k - 1], w["final_norm"]), embed[int(fed[k - 1])]])
            a = u @ w["chain_in"]
            x[k] = x[k] + (a / (1 + np.exp(-a))) @ w["chain_out"]
    head = f64(Shared.of(target).head)
    return (norm(x, w["final_norm"]) @ head.T)[1:]


# A tree of three levels (BLOCK - 1) with siblings at each: nodes 0, 1 below the root, 2 below 0,
# 3 below 1, 4 below 2.
PARENTS = (-1, -1, 0, 1, 2)


@pytest.mark.parametrize("t", [0, 5, 7])
def test_block_logits_match_the_numpy_reference_in_rollout_and_training(setup, t):
    """The training passes' block after token t equals the reference fed the data's tokens; the
    rollout's sampled tree (prefill of t + 1 tokens, then `propose_block` against the draft's
    cache) draws each node from the reference's distribution at its depth, fed the tokens of the
    path down to it (the same for siblings' children without the chained head)."""
    target, draft, tokens, taps = setup
    shared = Shared.of(target)
    seg, pos = jnp.ones_like(tokens), jnp.arange(T)[None]
    passes = block_passes(draft, shared, taps, tokens, seg, pos)
    got = jnp.stack([draft.draft_logits(h, shared)[0, t] for h in passes])
    close(got, reference_block_logits(target, draft, tokens, taps, t, tokens[0, t + 1 :]), 2e-5)

    rollout = draft.for_rollout()
    prefix, root = tokens[:, : t + 1], tokens[:, t + 1]
    cache = rollout.init_cache(1, 16)
    out = rollout.prefill(shared, prefix, jnp.array([t + 1]), root, taps[:, :, : t + 1], cache)
    config = RolloutConfig(tree=TreeConfig(kind="static", parents=PARENTS), temperature=1.0)
    tree = propose_block(rollout, shared, root, out.cache, jax.random.key(t), config)
    node_tokens = np.asarray(tree.tokens[0])
    for row, node in [(0, None), (1, 0), (2, 1), (3, 2)]:  # the root, then node i at row i + 1
        path, depth = [int(root[0])], 0
        while node is not None:
            path.insert(1, int(node_tokens[node]))
            node, depth = (PARENTS[node] if PARENTS[node] >= 0 else None), depth + 1
        fed = path + [0] * (BLOCK - len(path))
        want = reference_block_logits(target, draft, tokens, taps, t, fed)[depth]
        close(tree.draft_probs[0, row], jax.nn.softmax(want), rtol=2e-5)


def test_drafts_and_configs_it_cannot_serve_are_named_before_compiling(setup, tmp_path):
    target, draft, tokens, _ = setup
    lengths = jnp.array([3])
    bad_trees = [
        (TreeConfig(kind="chain", depth=BLOCK), r"trees of up to block_size - 1 = 3 levels"),
        (TreeConfig(kind="static", parents=(-1, 0, 1, 2, 0)), r"not a static tree of 4; set"),
    ]
    for tree, message in bad_trees:
        with pytest.raises(ConfigError, match=message):
            config = RolloutConfig(max_new_tokens=4, tree=tree)
            generate(target, draft, tokens[:, :3], lengths, jax.random.key(0), config)
    with pytest.raises(ConfigError, match=r"rollout.tree: a block draft proposes trees of up"):
        draft_config = DraftConfig(kind="block", block_size=3)
        RolloutConfig(draft=draft_config, tree=TreeConfig(depth=4)).validate(TARGET)
    with pytest.raises(ConfigError, match=r"rollout.draft.block_size=1 must be >= 2"):
        DraftConfig(kind="block", block_size=1).validate()
    with pytest.raises(ConfigError, match=r"holds no config.json; point at a block draft"):
        draft_factory.check_config(DraftConfig(kind="block", path=str(tmp_path)), TARGET)
    wide = dataclasses.replace(TARGET, hidden_size=48, head_dim=12)
    other = BlockDraft(BlockConfig.for_target(wide, BLOCK), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"block draft's hidden_size=48 differs from the"):
        check_target(other, TARGET)


# ---------------------------------------------------------------------------------------------
# DFlash's layout (jspec.models.hf_block).


def test_save_and_load_round_trip_exactly_in_dflashs_layout(setup, tmp_path):
    """Every weight comes back; the config names the target layers DFlash reads (the outputs of
    the layers before jspec's taps) and the block; without `mask_embedding` the mask is the
    target's embedding of dflash_config.mask_token_id, as DFlash's is."""
    target, draft, _, _ = setup
    hf_block.save(tmp_path, draft, TARGET)
    loaded = hf_block.load(tmp_path, TARGET)
    leaves = lambda d: jax.tree.leaves(nnx.state(d))
    for a, b in zip(leaves(loaded), leaves(draft), strict=True):
        np.testing.assert_array_equal(a, b)
    config = hf.read_json(tmp_path / hf.CONFIG)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == [t - 1 for t in TARGET.taps]
    tensors = load_file(tmp_path / hf.SINGLE)
    del tensors[hf_block.MASK]
    save_file(tensors, tmp_path / hf.SINGLE)
    config["dflash_config"]["mask_token_id"] = 7
    (tmp_path / hf.CONFIG).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"has no mask_embedding tensor; its mask is the target"):
        hf_block.load(tmp_path, TARGET)
    loaded = hf_block.load(tmp_path, TARGET, target_embedding=target.embed[...])
    np.testing.assert_array_equal(loaded.mask[...], target.embed[...][7])


def test_dflash_checkpoints_it_cannot_read_are_refused_by_name(setup, tmp_path):
    _, draft, _, _ = setup
    hf_block.save(tmp_path, draft, TARGET)
    config = hf.read_json(tmp_path / hf.CONFIG)
    five = {
        **config,
        "dflash_config": {**config["dflash_config"], "target_layer_ids": [0, 1, 2, 3, 4]},
    }
    changes = [
        (five, r"reads the outputs of target layers \[0, 1, 2, 3, 4\] \(the inputs of layers"),
        ({**config, "final_logit_softcapping": 20.0}, r"sets \['final_logit_softcapping'\]"),
        ({**config, "architectures": ["LlamaForCausalLM"]}, r"is not a DFlash draft"),
    ]
    for changed, message in changes:
        (tmp_path / hf.CONFIG).write_text(json.dumps(changed))
        with pytest.raises(ConfigError, match=message):
            hf_block.load(tmp_path, TARGET)
    (tmp_path / hf.CONFIG).write_text(json.dumps(config))
    tensors = load_file(tmp_path / hf.SINGLE)
    tensors["candidate_selector.hidden_projection.weight"] = np.zeros((4, 32), np.float32)
    save_file(tensors, tmp_path / hf.SINGLE)
    with pytest.raises(ConfigError, match=r"does not hold: \['candidate_selector.hidden_proj"):
        hf_block.load(tmp_path, TARGET)
