"""The MTP head: its logits against a reference built from `transformers`' Qwen3 blocks as MiMo
describes the module, exact save / load in MiMo's layout beside the policy, and clear refusals of
checkpoints it cannot read (its rollout path against its training pass: tests/test_rl.py)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import close, moved
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from jspec.config import ConfigError, ModelConfig
from jspec.models import create, hf, hf_mtp
from jspec.models.draft import Shared, check_target
from jspec.models.mtp import MTPConfig, create_mtp
from jspec.rl.draft_loss import draft_passes

TARGET = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    qk_norm=True,
    max_seq_len=64,
)
T = 10


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target and its MTP head (norm weights away from 1, so each norm is tested), saved in one
    policy directory, and a row of tokens."""
    path = tmp_path_factory.mktemp("policy")
    target = create(TARGET, seed=0)
    head = create_mtp(MTPConfig.for_target(TARGET), seed=1)
    graphdef, state = nnx.split(head)
    head = nnx.merge(graphdef, moved(state, seed=2))
    hf.save(path, target)
    hf_mtp.save(path, head)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TARGET.vocab_size, (1, T)))
    return path, target, head, tokens


def reference_logits(path, tokens):
    """Logits of MiMo's module at every position t (hidden state t, token t + 1), written from its
    description with `transformers`' Qwen3 blocks, and the target's final hidden states taken
    from `transformers`' own model."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config
    config._attn_implementation = "eager"
    w = {k: torch.from_numpy(v) for k, v in load_file(path / hf_mtp.MTP_FILE).items()}
    p = "model.mtp_layers.0."
    norm = lambda name: _rms_norm(config, w[p + name + ".weight"])
    layer = qwen3.Qwen3DecoderLayer(config, layer_idx=0).eval()
    layer.load_state_dict({k[len(p) :]: v for k, v in w.items() if _in_layer(k, p)})
    ids = torch.from_numpy(np.array(tokens))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        embeds = model.model.embed_tokens(torch.roll(ids, -1, dims=1))  # token t + 1 at t
        x = torch.cat([norm("hidden_layernorm")(hidden), norm("token_layernorm")(embeds)], -1)
        x = x @ w[p + "input_proj.weight"].T
        positions = torch.arange(T)[None]
        rope = qwen3.Qwen3RotaryEmbedding(config)(x, positions)
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        return model.lm_head(norm("final_layernorm")(x)).numpy()


def _rms_norm(config, weight):
    norm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight.data = weight
    return norm


def _in_layer(key: str, prefix: str) -> bool:
    rest = key[len(prefix) :]
    return rest.split(".")[0] in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def test_logits_match_the_reference_from_transformers_blocks(saved):
    path, target, head, tokens = saved
    loaded = hf_mtp.load(path, TARGET)
    _, features = target(tokens, features="final")
    seg, pos = jnp.ones_like(tokens), jnp.arange(T)[None]
    (hidden,) = draft_passes(loaded, Shared.of(target), features, tokens, seg, pos, steps=0)
    got = loaded.draft_logits(hidden, Shared.of(target))
    want = reference_logits(path, tokens)
    close(got[:, : T - 1], want[:, : T - 1], rtol=1e-4)  # the last position has no token t + 1


def test_save_and_load_round_trip_exactly(saved, tmp_path):
    path, target, head, _ = saved
    loaded = hf_mtp.load(path, TARGET)
    for a, b in zip(
        jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(head)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert hf.read_json(path / hf.CONFIG)[hf_mtp.COUNT] == 1
    np.testing.assert_array_equal(hf.load(path).embed[...], target.embed[...])  # the trunk reads


def test_checkpoints_it_cannot_read_are_refused_by_name(saved, tmp_path):
    path, target, _, _ = saved
    trunk = tmp_path / "trunk"
    hf.save(trunk, target)
    with pytest.raises(hf.CheckpointError, match=r"no MTP head 0 .* model\.mtp_layers\.0\.\*"):
        hf_mtp.load(trunk, TARGET)
    tensors = load_file(path / hf_mtp.MTP_FILE)
    add_tensors(
        trunk, {"model.layers.2.eh_proj.weight": tensors["model.mtp_layers.0.input_proj.weight"]}
    )
    with pytest.raises(
        hf.CheckpointError, match=r"MTP-like tensors found: \['model.layers.2.eh_pr"
    ):
        hf_mtp.load(trunk, TARGET)
    partial = shutil.copytree(path, tmp_path / "partial")
    index = hf.read_json(partial / hf.INDEX)
    del index["weight_map"]["model.mtp_layers.0.final_layernorm.weight"]
    (partial / hf.INDEX).write_text(json.dumps(index))
    with pytest.raises(hf.CheckpointError, match=r"'model.mtp_layers.0.final_layernorm.weight' of"):
        hf_mtp.load(partial, TARGET)
    biased = shutil.copytree(path, tmp_path / "biased")
    add_tensors(biased, {"model.mtp_layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
    with pytest.raises(hf.CheckpointError, match=r"does not hold: \['model.mtp_layers.0.self_attn"):
        hf_mtp.load(biased, TARGET)


def add_tensors(root, tensors):
    """`tensors` added to the checkpoint in `root`, in a file of their own listed in its index."""
    save_file(tensors, root / "extra.safetensors")
    weight_map = {**hf_mtp._weight_map(root), **dict.fromkeys(tensors, "extra.safetensors")}
    (root / hf.INDEX).write_text(json.dumps({"weight_map": weight_map}))


def test_a_head_of_another_width_is_refused_before_compiling():
    head = create_mtp(
        MTPConfig.for_target(dataclasses.replace(TARGET, hidden_size=48, head_dim=12))
    )
    with pytest.raises(
        ConfigError, match=r"MTP head's hidden_size=48 differs from the target's 32"
    ):
        check_target(head, TARGET)
