"""Qwen3-MoE: jspec gives transformers' logits and load-balancing loss, export round-trips, expert
parallelism gives one device's loss and gradients, and the rollout paths agree with the training
forward (the checks of test_transformer.py, rerun on a model with mixed dense and sparse layers).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hf
import test_transformer
import torch
import transformers
from flax import nnx
from helpers import noisy_copy
from test_transformer import (  # noqa: F401  (rerun here on the MoE model of `model`)
    fns,
    test_branch_forward_matches_root_to_node_paths,
    test_prefill_then_decode_matches_forward,
    test_rollout_on_a_mesh_matches_one_device,
    test_taps_are_layer_inputs,
)

from jspec import config as config_lib
from jspec.config import ConfigError, MeshConfig, RolloutConfig, TreeConfig
from jspec.mesh import make_mesh, sharding
from jspec.models import Transformer, create, hf, moe
from jspec.models.draft import Eagle3Config, ExternalDraft
from jspec.models.transformer import TRAIN_ACT
from jspec.sampler import generate

# test_transformer's model with 8 experts of width 32, top-2; layer 1 dense, layers 0 and 2 sparse.
CONFIG = dataclasses.replace(
    test_transformer.CONFIG,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=(1,),
    router_aux_loss_coef=0.5,  # large, so a wrong router gradient would show
    remat="none",
)
HF_VARIANTS = {
    "top2_of_8_normalised": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "top3_of_6_layer0_dense": dict(num_experts=6, num_experts_per_tok=3, mlp_only_layers=[0]),
    "top1_of_4_every_second": dict(num_experts=4, num_experts_per_tok=1, decoder_sparse_step=2),
}
DOCS = (7, 9, 12)  # jspec packs the first two in row 0; transformers gets one padded row each


@pytest.fixture(scope="module")
def model():
    return create(CONFIG)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers Qwen3MoeForCausalLM, its save_pretrained directory)."""
    out = {}
    for name, experts in HF_VARIANTS.items():
        config = transformers.Qwen3MoeConfig(**test_hf.SIZES, moe_intermediate_size=32, **experts)
        model = test_hf.hf_model(config)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = model, path
    return out


def batch(seed=0):
    """The DOCS as jspec rows (docs 0 and 1 packed, doc 2 then padding) and as transformers rows."""
    docs = [np.random.RandomState(seed + i).randint(0, 128, n) for i, n in enumerate(DOCS)]
    t = DOCS[0] + DOCS[1]
    tok = np.zeros((2, t), np.int32)
    seg = np.zeros((2, t), np.int32)
    pos = np.zeros((2, t), np.int32)
    for row, start, doc, seg_id in (
        (0, 0, docs[0], 1),
        (0, DOCS[0], docs[1], 2),
        (1, 0, docs[2], 1),
    ):
        end = start + len(doc)
        tok[row, start:end], seg[row, start:end], pos[row, start:end] = (
            doc,
            seg_id,
            np.arange(len(doc)),
        )
    hf_tok = np.zeros((3, max(DOCS)), np.int64)
    hf_mask = np.zeros((3, max(DOCS)), np.int64)
    for row, doc in enumerate(docs):
        hf_tok[row, : len(doc)], hf_mask[row, : len(doc)] = doc, 1
    return docs, (tok, seg, pos), (hf_tok, hf_mask)


@pytest.mark.parametrize("name", list(HF_VARIANTS))
def test_logits_and_load_balancing_loss_match_transformers(checkpoints, name):
    hf_m, path = checkpoints[name]
    model = hf.load(path)
    sparse = tuple(
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_m.model.layers
    )
    assert model.config.sparse_layers == sparse
    docs, rows, (hf_tok, hf_mask) = batch()
    graphdef, state = nnx.split(model)
    logits, aux = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a, aux_loss=True))(state, *rows)
    logits = np.asarray(logits)
    test_hf.close(logits[0, : DOCS[0]], test_hf.hf_logits(hf_m, docs[0]))
    test_hf.close(logits[0, DOCS[0] :], test_hf.hf_logits(hf_m, docs[1]))
    test_hf.close(logits[1, : DOCS[2]], test_hf.hf_logits(hf_m, docs[2]))
    with torch.no_grad():
        out = hf_m(
            torch.tensor(hf_tok), attention_mask=torch.tensor(hf_mask), output_router_logits=True
        )
    np.testing.assert_allclose(aux, out.aux_loss.numpy(), rtol=1e-5)


def test_export_round_trips_and_transformers_loads_it(checkpoints, tmp_path):
    hf_m, path = checkpoints["top3_of_6_layer0_dense"]
    model = hf.load(path)
    hf.save(tmp_path, model, max_shard_bytes=200_000)
    assert (tmp_path / hf.INDEX).is_file()
    again = hf.load(tmp_path)
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(exported) is type(hf_m)
    seq = batch()[0][2]
    np.testing.assert_array_equal(test_hf.hf_logits(exported, seq), test_hf.hf_logits(hf_m, seq))


def test_load_places_experts_sharded(checkpoints):
    _, path = checkpoints["top2_of_8_normalised"]
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    model = hf.load(path, mesh=mesh)
    w_gate = model.moe_layers.moe.w_gate[...]
    names = ("layers", "expert", "embed", "moe_mlp")
    assert w_gate.sharding.is_equivalent_to(sharding(mesh, names), 4)
    assert w_gate.addressable_shards[0].data.shape == (3, 2, 64, 16)  # 8/4 experts, 32/2 wide
    plain = hf.load(path)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), nnx.state(plain))


# ---------------------------------------------------------------------------------------------
# Expert parallelism.

# Documents of 12 and 4 tokens per row: multiples of 2 * cp for the context-parallel mesh.
TRAIN_BATCH = (
    np.random.RandomState(3).randint(0, CONFIG.vocab_size, (8, 16)).astype(np.int32),
    np.repeat(np.array([[1] * 12 + [2] * 4]), 8, axis=0).astype(np.int32),
    np.repeat(np.array([list(range(12)) + list(range(4))]), 8, axis=0).astype(np.int32),
)


@pytest.fixture(scope="module")
def reference(model):
    graphdef, state = nnx.split(model)
    return jax.jit(jax.value_and_grad(test_transformer.loss_fn(graphdef)))(state, *TRAIN_BATCH)


@pytest.mark.parametrize(
    "shape",
    [dict(data=2, tensor=4), dict(data=2, context=2, tensor=2), dict(data=8)],
)
def test_expert_parallel_loss_and_grads_match_one_device(model, reference, shape):
    """Experts over data x context 2, 2 x 2 and 8 ways, with tensor splitting their width."""
    mesh = make_mesh(MeshConfig(**shape))
    grad = test_transformer.assert_sharded_matches(
        model, mesh, TRAIN_BATCH, reference, grad_rtol=1e-5
    )
    w_gate = grad["moe_layers"]["moe"]["w_gate"][...]
    assert w_gate.sharding.is_equivalent_to(
        sharding(mesh, ("layers", "expert", "embed", "moe_mlp")), 4
    )


@pytest.mark.parametrize("tensor", [1, 2])
def test_expert_group_of_one_device_needs_no_exchange(tensor):
    """Every mesh axis of size 1 (or tensor alone): the sharded path equals the mesh-less one."""
    mesh = make_mesh(MeshConfig(data=1, tensor=tensor), jax.devices()[:tensor])
    rng = np.random.RandomState(1)
    x = rng.normal(size=(2, 4, 16)).astype(np.float32)
    experts = rng.randint(0, 8, (2, 4, 2)).astype(np.int32)
    weights = rng.uniform(size=(2, 4, 2)).astype(np.float32)
    w = [rng.normal(size=s).astype(np.float32) for s in ((8, 16, 4), (8, 16, 4), (8, 4, 16))]
    run = lambda x_AD, sizes_X: moe.swiglu_experts(x_AD, sizes_X, *w)
    flat = lambda a: a.reshape(8, -1)
    want = moe.experts_forward(flat(x), flat(experts), flat(weights), 8, run).reshape(x.shape)
    got = jax.jit(functools.partial(moe.sharded_experts_forward, mesh, TRAIN_ACT))(
        x, experts, weights, *w
    )
    test_transformer.close(got, want)


def test_cpu_exchange_follows_ragged_all_to_all_as_documented():
    """The example of `jax.lax.ragged_all_to_all`'s docstring, through the CPU emulation."""
    mesh = make_mesh(MeshConfig(data=2), jax.devices()[:2])
    per_device = lambda *rows: np.asarray(rows, np.int32)  # row r: device r's argument
    args = (
        per_device([1, 2, 2], [3, 4, 0]),  # operand
        per_device([0, 0, 0, 0], [0, 0, 0, 0]),  # output
        per_device([0, 1], [0, 1]),  # input_offsets
        per_device([1, 2], [1, 1]),  # send_sizes
        per_device([0, 0], [1, 2]),  # output_offsets
        per_device([1, 1], [2, 1]),  # recv_sizes
    )
    exchange = lambda *a: moe._ragged_all_to_all_emulated(*(x[0] for x in a), axis_name="data")
    spec = jax.sharding.PartitionSpec("data")
    got = jax.shard_map(lambda *a: exchange(*a)[None], mesh=mesh, in_specs=spec, out_specs=spec)(
        *args
    )
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_gpu_exchange_traces_with_its_gradient(monkeypatch):
    """XLA:CPU cannot run `jax.lax.ragged_all_to_all`, but it can lower the GPU path: the exchange
    and its transpose type-check inside shard_map (the GPU benchmark checks its values)."""
    monkeypatch.setattr(moe, "_ragged_all_to_all", lambda mesh: jax.lax.ragged_all_to_all)
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    rng = np.random.RandomState(0)
    x = rng.normal(size=(4, 8, 16)).astype(np.float32)
    experts = rng.randint(0, 8, (4, 8, 2)).astype(np.int32)
    w_in, w_out = rng.normal(size=(8, 16, 4)), rng.normal(size=(8, 4, 16))
    forward = functools.partial(moe.sharded_experts_forward, mesh, TRAIN_ACT)
    loss = lambda *a: forward(*a).sum()
    lowered = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 5))).lower(
        x, experts, np.ones((4, 8, 2), np.float32), w_in, w_in, w_out
    )
    assert lowered.as_text().count("ragged_all_to_all") == 4  # out and back, forward and backward


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "num_experts_per_tok",
            9,
            r"model.num_experts_per_tok=9 must be between 1 and model.num_experts=8",
        ),
        ("moe_intermediate_size", 0, r"model.moe_intermediate_size=0 must be positive when"),
        ("mlp_only_layers", (1, 3), r"model.mlp_only_layers=\(1, 3\) names layers \[3\] outside"),
        ("decoder_sparse_step", 0, r"model.decoder_sparse_step=0 must be at least 1"),
    ],
)
def test_bad_moe_config_is_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(CONFIG, **{field: value}).validate()


def test_experts_that_do_not_divide_the_mesh_are_refused():
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    config = dataclasses.replace(CONFIG, num_experts=6)
    with pytest.raises(ConfigError, match=r"model.num_experts=6 is not divisible by 4.*mesh.data"):
        Transformer(config, rngs=nnx.Rngs(0), mesh=mesh)


def test_rows_that_do_not_divide_the_expert_group_are_refused(model):
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    graphdef = test_transformer.graphdef_for(CONFIG, mesh)
    forward = lambda s, tok: nnx.merge(graphdef, s)(tok)
    with pytest.raises(ConfigError, match=r"activation axis 0 \('batch', 2 long\).*multiple of 4"):
        jax.eval_shape(forward, nnx.state(model), np.zeros((2, 8), np.int32))


SHIPPED = [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)]


@pytest.mark.parametrize(("name", "total", "active"), SHIPPED)
def test_shipped_moe_configs_have_the_published_sizes(name, total, active):
    """Parameter counts (all, and active per token) of the shipped configs, abstractly."""
    c = config_lib.load(name).model
    state = nnx.state(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    experts = sum(math.prod(x.shape) for x in jax.tree.leaves(state["moe_layers"]["moe"]))
    idle = experts * (1 - c.num_experts_per_tok / c.num_experts)  # the router's share is ~0
    assert count == pytest.approx(total, rel=0.02)
    assert count - idle == pytest.approx(active, rel=0.02)


def test_greedy_generate_with_a_draft_equals_plain_decoding(model):
    """Speculative decoding of an MoE target, the draft a noisy copy of it (it agrees in part)."""
    rng = np.random.default_rng(5)
    lengths = jnp.asarray([6, 3, 5, 4], jnp.int32)
    prompts = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (4, 6)), jnp.int32)
    tree = TreeConfig(kind="static", parents=(-1, -1, 0, 0, 1), sampled=False)
    config = RolloutConfig(max_new_tokens=9, temperature=0.0, tree=tree)
    plain = generate(model, None, prompts, lengths, jax.random.key(0), config)
    draft = ExternalDraft(noisy_copy(model, 0.1))
    spec = generate(model, draft, prompts, lengths, jax.random.key(0), config)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert 1.2 < spec.stats.mean_accepted_length() < 4
    Eagle3Config.for_target(CONFIG).validate()  # an EAGLE-3 head on an MoE target is dense
