"""The EAGLE-3 draft: its layer against an independent PyTorch implementation of the published
draft (expected logits in fixtures/eagle3-tiny, see its README), both public checkpoint layouts,
exact round trips, and clear errors for checkpoints that do not fit."""

import dataclasses
import json
import pathlib
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import close
from safetensors.numpy import load_file, save_file

from jspec.config import ConfigError, DraftConfig, MeshConfig, ModelConfig
from jspec.mesh import make_mesh
from jspec.models import create, hf
from jspec.models import hf_eagle3 as eagle_io
from jspec.models.draft import (
    Eagle3Config,
    Eagle3Draft,
    check_target,
    create_eagle3,
    frequent_tokens,
)
from jspec.models.draft_factory import check_config, from_config

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "eagle3-tiny"
# A target of the fixture draft's shape.
FIXTURE_TARGET = ModelConfig(
    vocab_size=300,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
)


def fixture_logits(draft, embedding):
    """The draft's logits on the fixture's case: one causal pass over positions 0..15."""
    case = np.load(FIXTURE / "case.npz")
    ids, hidden = case["input_ids"], case["hidden_states"]
    b, t = ids.shape
    taps = jnp.stack(jnp.split(jnp.asarray(hidden), 3, axis=-1))  # concatenated in tap order
    seg = jnp.ones((b, t), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = draft(jnp.asarray(embedding[ids]), taps, seg, pos)
    return logits, case["logits"]


def test_logits_match_the_reference_implementation():
    draft, found = eagle_io.load(FIXTURE)
    assert found.layout == "eagle" and not found.norm_before_residual
    assert found.embedding is not None and "own embed_tokens" in found.describe()
    got, want = fixture_logits(draft, found.embedding)
    close(got, want, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_copy_computes_what_the_draft_computes(dtype):
    """`for_rollout`, before a loop of steps: products fused, the norms before gate/up and before
    the head folded into them (the fixture's norm weights are far from 1), the float32 weights
    cast to the compute dtype once: the draft's logits to the compute dtype's rounding."""
    draft, found = eagle_io.load(FIXTURE)
    layer = dataclasses.replace(draft.config.layer, dtype=dtype)
    config = dataclasses.replace(draft.config, layer=layer)
    graphdef = nnx.split(nnx.eval_shape(lambda: Eagle3Draft(config, rngs=nnx.Rngs(0))))[0]
    model = nnx.merge(graphdef, nnx.state(draft))
    rollout = model.for_rollout()
    assert rollout.mlp_norm is None and rollout.final_norm is None
    assert model.mlp_norm is not None and model.final_norm is not None
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(rollout))}
    assert dtypes == {jnp.dtype(dtype), jnp.dtype("int32")}  # int32: the vocabulary map
    got, _ = fixture_logits(rollout, found.embedding)
    want, reference = fixture_logits(model, found.embedding)
    close(got, want, rtol=1e-5 if dtype == "float32" else 2e-2)
    close(got, reference, rtol=0.1)  # near the float32 reference


def rename_layer(src, dst, prefix="layers.0", drop=(), config_edit=None):
    """A copy of a checkpoint with the decoder layer under `prefix` and some tensors dropped."""
    dst.mkdir()
    tensors = {
        k.replace("midlayer.", f"{prefix}."): v
        for k, v in load_file(src / "model.safetensors").items()
        if k not in drop
    }
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **(config_edit or {})}))
    return dst


def concatenated_case():
    """The fixture draft and its case's inputs, the taps concatenated [2, 16, 192] as published."""
    draft, found = eagle_io.load(FIXTURE)
    case = np.load(FIXTURE / "case.npz")
    ids = case["input_ids"]
    seg = jnp.ones(ids.shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    embeds = jnp.asarray(found.embedding[ids])
    return draft, found, embeds, jnp.asarray(case["hidden_states"]), seg, pos


def test_concatenated_taps_give_the_same_logits():
    """Public EAGLE-3 code passes the three taps concatenated, [B,T,3H]: read as the stacked taps
    are."""
    draft, found, embeds, hidden, seg, pos = concatenated_case()
    logits, _ = draft(embeds, hidden, seg, pos)
    np.testing.assert_array_equal(logits, fixture_logits(draft, found.embedding)[0])


def test_features_of_another_shape_are_named():
    """Neither taps, their concatenation nor a hidden state: the message names what it got and
    what it takes, instead of a broadcasting error deep in the layer."""
    draft, _, embeds, hidden, seg, pos = concatenated_case()
    with pytest.raises(ValueError, match=r"features has shape \(2, 16, 128\); .* \(3, 2, 16, 64\)"):
        draft(embeds, hidden[..., :128], seg, pos)
    with pytest.raises(ValueError, match=r"concatenation \[B, T, 3\*D\] = \(2, 16, 192\)"):
        draft(embeds, hidden[:, :8], seg, pos)  # fewer positions than embeds


def fitting_target(seed):
    """A random target of the fixture draft's shape; its embedding differs with the seed."""
    return create(FIXTURE_TARGET, seed=seed)


def test_draft_trained_for_another_target_is_refused(tmp_path):
    """A draft carrying the embedding of target A is refused for target B of the same shape (or
    loaded with a warning when allowed) and loads silently for A, whose embedding it may hold
    rounded to bfloat16."""
    a, b = fitting_target(0), fitting_target(1)
    draft, _ = eagle_io.load(FIXTURE)
    rounded = np.asarray(a.embed[...].astype(jnp.bfloat16).astype(jnp.float32))
    eagle_io.save(tmp_path, draft, embedding=rounded)
    config = DraftConfig(kind="eagle3", path=str(tmp_path))
    message = (
        f"the EAGLE-3 draft in {re.escape(str(tmp_path))} carries an embed_tokens.weight that "
        "differs from the "
        r"target's embedding \(300 of 300 rows beyond bf16 rounding, max abs difference [0-9.e-]+\)"
        r": it was trained for another target; load the draft trained for this target, or set "
        r"rollout.draft.allow_other_target=true"
    )
    with pytest.raises(hf.CheckpointError, match=message):
        from_config(config, b)
    with pytest.warns(UserWarning, match="it was trained for another target; loading it anyway"):
        assert from_config(dataclasses.replace(config, allow_other_target=True), b) is not None
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    sharded = create(a.config, mesh=mesh, seed=0)  # compared where it lives, slice by slice
    np.testing.assert_array_equal(sharded.embed[...], a.embed[...])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_config(config, a) is not None
        assert from_config(config, sharded, mesh=mesh) is not None
    found = eagle_io.load(tmp_path)[1]
    with pytest.raises(
        hf.CheckpointError, match=r"shape \(300, 64\), but the target's .*\(400, 64\)"
    ):
        eagle_io.check_embedding(tmp_path, found, np.zeros((400, 64)), allow_other_target=True)
    without = rename_layer(tmp_path, tmp_path / "without", "midlayer", drop=(eagle_io.EMBED,))
    assert from_config(dataclasses.replace(config, path=str(without)), b) is not None


def test_loaded_draft_computes_like_a_fresh_one():
    """A draft loaded for a bfloat16 target computes and is stored as a fresh draft of that
    target is, whatever dtype its checkpoint was saved in (here float32)."""
    target = create(dataclasses.replace(FIXTURE_TARGET, dtype="bfloat16", remat="dots"), seed=0)
    fixture = DraftConfig(kind="eagle3", path=str(FIXTURE), allow_other_target=True)
    with pytest.warns(UserWarning, match="trained for another target"):
        loaded = from_config(fixture, target)
    fresh = from_config(DraftConfig(kind="eagle3"), target)
    for name in ("dtype", "param_dtype", "remat"):
        assert getattr(loaded.config.layer, name) == getattr(fresh.config.layer, name), name
    assert loaded.config.layer.dtype == "bfloat16" and loaded.config.layer.remat == "dots"


def test_speculators_layout_without_embedding_loads_the_same(tmp_path):
    path = rename_layer(FIXTURE, tmp_path / "spec", drop=("embed_tokens.weight",))
    draft, found = eagle_io.load(path)
    assert found.layout == "speculators" and found.embedding is None
    embedding = eagle_io.load(FIXTURE)[1].embedding  # the target's, here the fixture's copy
    got, want = fixture_logits(draft, embedding)
    close(got, want, rtol=1e-5)


def test_norm_before_residual_is_read_and_changes_the_layer(tmp_path):
    edit = {"norm_before_residual": True}
    path = rename_layer(FIXTURE, tmp_path / "nbr", "midlayer", config_edit=edit)
    draft, found = eagle_io.load(path)
    assert found.norm_before_residual and draft.config.norm_before_residual
    got, want = fixture_logits(draft, found.embedding)
    assert np.abs(np.asarray(got) - want).max() > 1e-3 * np.abs(want).max()


def test_the_target_layers_a_draft_reads_are_checked_and_written(tmp_path):
    """A checkpoint's eagle_aux_hidden_state_layer_ids (vLLM's and speculators' name for the
    target layers whose inputs the draft reads) must be the target's taps, checked from its
    config.json before any weight is read; a draft trained by jspec writes its target's."""
    edit = {eagle_io.TAPS: [2, 1, 0]}
    path = rename_layer(FIXTURE, tmp_path / "taps", "midlayer", config_edit=edit)
    draft, _ = eagle_io.load(path)
    assert draft.config.tap_layers == (2, 1, 0)
    default = FIXTURE_TARGET  # taps (0, 1, 2)
    with pytest.raises(ConfigError, match=r"target layers \[2, 1, 0\] .* model.tap_layers=\[2, 1"):
        check_config(DraftConfig(kind="eagle3", path=str(path)), default)
    reordered = dataclasses.replace(default, tap_layers=(2, 1, 0))
    check_target(draft, reordered)
    fresh = from_config(DraftConfig(kind="eagle3"), create(reordered))
    eagle_io.save(tmp_path / "saved", fresh)
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written[eagle_io.TAPS] == [2, 1, 0]
    assert eagle_io.load(FIXTURE)[0].config.tap_layers is None  # EAGLE's own layout: not said


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_save_then_load_round_trips_exactly(tmp_path, layout):
    draft, found = eagle_io.load(FIXTURE)
    eagle_io.save(tmp_path, draft, layout=layout, embedding=found.embedding)
    again, found_again = eagle_io.load(tmp_path)
    assert found_again.layout == layout
    np.testing.assert_array_equal(found_again.embedding, found.embedding)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(draft)), nnx.to_flat_state(nnx.state(again)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    original = load_file(FIXTURE / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    if layout == "eagle":  # the public file itself comes back, d2t and t2d included
        assert written.keys() == original.keys()
        for key in original:
            np.testing.assert_array_equal(written[key], original[key], err_msg=key)


def test_draft_fits_only_a_target_of_its_shape():
    draft, _ = eagle_io.load(FIXTURE)
    layer = draft.config.layer
    fits = FIXTURE_TARGET
    check_target(draft, fits)
    with pytest.raises(ConfigError, match="hidden_size=64 differs from the target's 32"):
        check_target(draft, ModelConfig(**{**vars(fits), "hidden_size": 32}))
    with pytest.raises(ConfigError, match="maps its vocabulary into 300 target tokens"):
        check_target(draft, ModelConfig(**{**vars(fits), "vocab_size": 400}))
    with pytest.raises(ConfigError, match="a model of 2 layers has fewer than 3"):
        check_target(draft, ModelConfig(**{**vars(fits), "num_layers": 2}))
    assert layer.num_layers == 1


def test_checkpoint_mistakes_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        eagle_io.load(tmp_path)
    bad = rename_layer(FIXTURE, tmp_path / "no-layer", "decoder")
    with pytest.raises(ValueError, match="no decoder layer found"):
        eagle_io.load(bad)
    shutil.copytree(FIXTURE, tmp_path / "d2t")
    tensors = load_file(tmp_path / "d2t" / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + 250  # past the 300-token target vocabulary
    save_file(tensors, tmp_path / "d2t" / "model.safetensors")
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target vocabulary"):
        eagle_io.load(tmp_path / "d2t")
    target_model = create(ModelConfig(vocab_size=300, hidden_size=64, num_layers=3))
    hf.save(tmp_path / "target", target_model)
    with pytest.raises(ValueError, match="no draft_vocab_size"):
        eagle_io.load(tmp_path / "target")


@pytest.mark.parametrize(("layout", "prefix"), list(eagle_io.LAYOUTS.items()))
def test_missing_draft_tensor_is_named_with_its_layout(tmp_path, layout, prefix):
    """The message names the tensor, the layout and the draft, not the target loader's hint."""
    path = rename_layer(FIXTURE, tmp_path / layout, prefix, drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(hf.CheckpointError) as error:
        eagle_io.load(path)
    message = str(error.value)
    assert message.startswith(
        f"tensor '{prefix}.hidden_norm.weight' is missing from the EAGLE-3 draft in {path} "
        f"({layout} layout: {prefix}.*, read from model.safetensors)"
    )
    assert "num_hidden_layers" not in message and "tie_word_embeddings" not in message


def test_draft_vocabulary_of_the_most_frequent_tokens():
    counts = np.array([5, 0, 9, 9, 1, 7])
    np.testing.assert_array_equal(frequent_tokens(counts, 3), [2, 3, 5])
    target = ModelConfig(vocab_size=6, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1)
    draft = create_eagle3(
        Eagle3Config.for_target(target, draft_vocab_size=3), target_ids=frequent_tokens(counts, 3)
    )
    logits = draft.to_target_vocab(jnp.array([[1.0, 2.0, 3.0]]))
    np.testing.assert_array_equal(logits[0], [-np.inf, -np.inf, 1.0, 2.0, -np.inf, 3.0])


def test_rollout_copy_of_a_whole_vocabulary_draft_gives_its_logits_in_target_order():
    """A draft of the whole vocabulary, in any order of target ids: its rollout copy puts the
    head's rows in target order, so its logits need no scatter, and they are the original's."""
    target = ModelConfig(vocab_size=6, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1)
    draft = create_eagle3(Eagle3Config.for_target(target), target_ids=[3, 0, 5, 1, 4, 2])
    rollout = draft.for_rollout()
    assert rollout.target_order and not draft.target_order
    hidden = jax.random.normal(jax.random.key(0), (2, 3, 16))
    logits = lambda d: d.to_target_vocab(d.draft_logits(hidden, None))
    close(logits(rollout), logits(draft), rtol=1e-6)


def test_a_draft_vocabulary_that_does_not_fit_the_tensor_axis_is_refused():
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    config = Eagle3Config.for_target(FIXTURE_TARGET, 257)
    with pytest.raises(
        ConfigError, match=r"rollout\.draft\.vocab_size=257 is not divisible by 2.*mesh\.tensor"
    ):
        create_eagle3(config, mesh=mesh)
