"""Hugging Face checkpoints: jspec gives the logits of `transformers` (float32), export round-trips,
and bad checkpoints fail with messages that name the problem."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import close
from safetensors.numpy import load_file, save_file

from jspec.config import MeshConfig, RopeScaling
from jspec.mesh import make_mesh, sharding
from jspec.models import hf

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,  # short, so positions < 32 reach every frequency band
)
VARIANTS = {
    "qwen3": lambda: transformers.Qwen3Config(**SIZES),
    "qwen3_tied": lambda: transformers.Qwen3Config(**SIZES, tie_word_embeddings=True),
    "llama3": lambda: transformers.LlamaConfig(
        **SIZES, rope_scaling=LLAMA3_ROPE, rope_theta=500_000.0
    ),
    "llama3_tied": lambda: transformers.LlamaConfig(
        **SIZES, rope_scaling=LLAMA3_ROPE, rope_theta=500_000.0, tie_word_embeddings=True
    ),
}


def hf_model(name_or_config, seed=0):
    """A tiny random model built by transformers (of a VARIANTS name or a transformers config),
    with weights large enough that attention is far from uniform (mean max attention probability
    ~0.7-0.9 here)."""
    torch.manual_seed(seed)
    config = VARIANTS[name_or_config]() if isinstance(name_or_config, str) else name_or_config
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "q_norm" in key or "k_norm" in key:
                p.normal_(0.0, 2.0)  # qk-norm fixes |q|, |k|: its weight sets the logit scale
            elif "norm" in key:
                p.normal_(1.0, 0.4)
            else:
                p.normal_(0.0, 0.4)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory)."""
    out = {}
    for name in VARIANTS:
        model = hf_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = model, path
    return out


def hf_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(seq))[None]).logits[0].numpy()


def jspec_logits(model, tok, seg=None, pos=None):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))
    return np.asarray(fn(state, tok, seg, pos))


def two_rows(seed=0):
    """Row 0 packs documents of 7 and 9 tokens (positions restart); row 1 is one 16-token doc."""
    docs = [np.random.RandomState(seed + i).randint(0, 128, n) for i, n in enumerate((7, 9, 16))]
    tok = np.stack([np.concatenate(docs[:2]), docs[2]]).astype(np.int32)
    seg = np.array([[1] * 7 + [2] * 9, [1] * 16], np.int32)
    pos = np.array([list(range(7)) + list(range(9)), list(range(16))], np.int32)
    return docs, tok, seg, pos


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_including_packed_rows(checkpoints, name):
    hf_m, path = checkpoints[name]
    model = hf.load(path)
    assert model.config.qk_norm == name.startswith("qwen3")
    assert model.config.tie_embeddings == name.endswith("tied")
    assert (model.config.rope_scaling is not None) == name.startswith("llama3")
    docs, tok, seg, pos = two_rows()
    got = jspec_logits(model, tok, seg, pos)
    close(got[0, :7], hf_logits(hf_m, docs[0]), rtol=1e-4)
    close(got[0, 7:], hf_logits(hf_m, docs[1]), rtol=1e-4)
    close(got[1], hf_logits(hf_m, docs[2]), rtol=1e-4)


@pytest.mark.parametrize(("name", "max_shard_bytes"), [("qwen3", 60_000), ("llama3_tied", None)])
def test_export_round_trips_and_transformers_loads_it(checkpoints, tmp_path, name, max_shard_bytes):
    hf_m, path = checkpoints[name]
    model = hf.load(path)
    hf.save(tmp_path, model, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / hf.INDEX).is_file() == (max_shard_bytes is not None)

    again = hf.load(tmp_path)
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    seq = two_rows()[0][2]
    want = hf_logits(hf_m, seq)
    np.testing.assert_array_equal(hf_logits(exported, seq), want)
    close(jspec_logits(again, seq[None])[0], want, rtol=1e-4)


def test_export_keeps_the_context_of_the_checkpoint_it_started_from(checkpoints, tmp_path):
    path = checkpoints["qwen3"][1]
    trained_for = hf.read_json(path / hf.CONFIG)["max_position_embeddings"]
    shorter = hf.load(path, max_seq_len=trained_for // 4)  # a run at a shorter context
    longer = hf.load(path, max_seq_len=trained_for * 2)  # one that extended it
    for model in (shorter, longer):
        hf.save(tmp_path / "from", model, context=hf.trained_context(path, model.config))
        hf.save(tmp_path / "scratch", model, context=hf.trained_context(None, model.config))
        context = lambda d: hf.read_json(tmp_path / d / hf.CONFIG)["max_position_embeddings"]
        want = max(trained_for, model.config.max_seq_len), model.config.max_seq_len
        assert (context("from"), context("scratch")) == want


def test_load_places_parameters_sharded(checkpoints):
    _, path = checkpoints["qwen3"]
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    model = hf.load(path, mesh=mesh)
    wq = model.layers.wq[...]
    assert wq.sharding.is_equivalent_to(sharding(mesh, ("layers", "embed", "heads", "head_dim")), 4)
    assert wq.addressable_shards[0].data.shape == (3, 64, 2, 16)  # half the heads per device
    plain = hf.load(path)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), nnx.state(plain))


def test_dtype_follows_the_checkpoint_unless_asked(tmp_path):
    hf_model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path)
    model = hf.load(tmp_path)
    assert model.config.param_dtype == model.config.dtype == "bfloat16"
    assert model.embed[...].dtype == jnp.bfloat16
    as_f32 = hf.load(tmp_path, dtype="float32")
    assert as_f32.layers.w_up[...].dtype == jnp.float32
    np.testing.assert_array_equal(as_f32.embed[...], model.embed[...].astype(jnp.float32))


@pytest.mark.parametrize("layers", [1, 2])
def test_checkpoints_of_any_layer_count_load(tmp_path, layers):
    """Only a model with an EAGLE-3 draft attached needs three distinct tap layers."""
    config = transformers.Qwen3Config(**{**SIZES, "num_hidden_layers": layers})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert hf.load(tmp_path).config.num_layers == layers


def test_config_from_legacy_hf_dict():
    """transformers 4 wrote rope_theta at the top level and Llama 3 scaling under rope_scaling."""
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        **{k: v for k, v in SIZES.items() if k != "head_dim"},
        "rope_theta": 500_000.0,
        "rope_scaling": LLAMA3_ROPE,
        "torch_dtype": "bfloat16",
    }
    config = hf.config_from_hf(legacy)
    assert config.rope_theta == 500_000.0
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert config.head_dim == 16 and config.param_dtype == "bfloat16"
    assert hf.config_from_hf(hf.config_to_hf(config)) == config


# ---------------------------------------------------------------------------------------------
# Bad checkpoints.


def copy_checkpoint(src, dst, config_edit=None, drop=None):
    config = json.loads((src / hf.CONFIG).read_text())
    if config_edit:
        config.update(config_edit)
    (dst / hf.CONFIG).write_text(json.dumps(config))
    tensors = load_file(src / hf.SINGLE)
    if drop:
        del tensors[drop]
    save_file(tensors, dst / hf.SINGLE, metadata={"format": "pt"})


def test_unknown_architecture_is_named(checkpoints, tmp_path):
    copy_checkpoint(checkpoints["qwen3"][1], tmp_path, {"architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(hf.CheckpointError, match="Qwen2ForCausalLM is not supported.*Llama"):
        hf.load(tmp_path)


def test_missing_files_are_named(checkpoints, tmp_path):
    with pytest.raises(hf.CheckpointNotFoundError, match=f"{tmp_path}/config.json not found"):
        hf.load(tmp_path)
    copy_checkpoint(checkpoints["qwen3"][1], tmp_path)
    (tmp_path / hf.SINGLE).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors nor .*index.json exists"):
        hf.load(tmp_path)
    shard = {"model.embed_tokens.weight": "model-1-of-2.safetensors"}
    (tmp_path / hf.INDEX).write_text(json.dumps({"weight_map": shard}))
    with pytest.raises(FileNotFoundError, match="model-1-of-2.safetensors .*not found"):
        hf.load(tmp_path)


def test_a_weights_file_cut_short_is_named(checkpoints, tmp_path):
    copy_checkpoint(checkpoints["qwen3"][1], tmp_path)
    weights = tmp_path / hf.SINGLE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(hf.CheckpointError, match=r"model.safetensors is not a readable safetens"):
        hf.load(tmp_path)


def test_missing_tensor_is_named_with_its_file(checkpoints, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"
    copy_checkpoint(checkpoints["llama3"][1], tmp_path, drop=key)
    with pytest.raises(hf.CheckpointError, match=rf"'{key}' is missing from .*model.safetensors"):
        hf.load(tmp_path)


def test_shape_mismatch_is_named(checkpoints, tmp_path):
    copy_checkpoint(checkpoints["llama3"][1], tmp_path, {"intermediate_size": 128})
    key = "model.layers.0.mlp.down_proj.weight"  # parameters load in name order: w_down first
    match = rf"'{key}' in .*model.safetensors has shape \(64, 96\).* implies \(64, 128\)"
    with pytest.raises(hf.CheckpointError, match=match):
        hf.load(tmp_path)
