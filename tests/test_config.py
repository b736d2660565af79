"""Configs load, override and fail with messages that name the field and the fix."""

import jax
import pytest

from jspec import config, mesh
from jspec.config import ConfigError, MeshConfig


@pytest.mark.parametrize("name", ["tiny", "demo", "qwen3-0.6b", "qwen3-8b", "llama-3.1-8b"])
def test_shipped_configs_load(name):
    cfg = config.load(name)
    assert cfg.name == name
    assert len(set(cfg.model.taps)) == 3


def test_real_families_match_their_published_shapes():
    llama = config.load("llama-3.1-8b").model
    assert (llama.num_layers, llama.num_kv_heads, llama.rope_scaling.factor) == (32, 8, 8.0)
    assert llama.taps == (2, 16, 29)  # EAGLE-3: inputs of layers 2, L/2, L-3
    assert config.load("qwen3-0.6b").model.tie_embeddings


def test_default_taps_are_distinct_for_every_layer_count():
    for n in range(3, 80):
        taps = config.ModelConfig(num_layers=n).taps
        assert len(set(taps)) == 3 and all(0 <= t < n for t in taps), (n, taps)
    assert config.ModelConfig(num_layers=36).taps == (2, 18, 33)  # EAGLE-3's own choice
    config.ModelConfig(num_layers=2).validate()  # loads: only a draft needs three taps
    with pytest.raises(ConfigError, match="a model of 2 layers has fewer than 3"):
        config.ModelConfig(num_layers=2).check_taps()
    with pytest.raises(ConfigError, match="a model of 2 layers has fewer than 3"):
        config.load("tiny", ["model.num_layers=2", "rollout.draft.kind=eagle3"])


def test_rollout_section_loads_with_nested_draft_model():
    cfg = config.load(
        "tiny",
        [
            "rollout.draft.kind=external",
            "rollout.draft.model={num_layers: 2, hidden_size: 32}",
            "rollout.tree.kind=static",
            "rollout.tree.parents=[-1,-1,0]",
        ],
    )
    assert cfg.rollout.draft.model.num_layers == 2 and cfg.rollout.tree.num_nodes == 3


def test_dotted_overrides():
    cfg = config.load("tiny", ["model.num_layers=12", "model.tap_layers=[1,5,9]", "seed=3"])
    assert cfg.model.num_layers == 12 and cfg.model.taps == (1, 5, 9) and cfg.seed == 3
    assert config.load("tiny", ["model.qk_norm=false"]).model.qk_norm is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.num_layer=4"],
            r"unknown config field model.num_layer; did you mean "
            r"model.num_layers\?",
        ),
        (["model.num_heads=5"], r"model.num_heads=5 is not a multiple of model.num_kv_heads=2"),
        (["model.tap_layers=[1,1,2]"], r"model.tap_layers=\(1, 1, 2\) must be distinct"),
        (["model.tap_layers=[1,2,8]"], r"must be distinct layer indices in \[0, 8\)"),
        (["rollout.tree.kind=bushy"], r"rollout.tree.kind='bushy' is not one of 'chain'"),
        (["rollout.draft.kind=medusa"], r"rollout.draft.kind='medusa' is not one of 'eagle3'"),
        (["rollout.draft.kind=external"], r"needs rollout.draft.path .* or rollout.draft.model"),
        (["rollout.tree.kind=static", "rollout.tree.parents=[-1,1]"], r"parents\[1\]=1 is not"),
        (
            ["rollout.tree.kind=dynamic", "rollout.tree.top_k=2", "rollout.tree.depth=2"]
            + ["rollout.tree.sampled=false"],
            r"total_tokens=8 exceeds the 6 candidates",
        ),
        (
            ["rollout.tree.kind=dynamic", "rollout.tree.top_k=2", "rollout.tree.depth=2"],
            r"total_tokens=8: a sampled dynamic tree of depth=2 and top_k=2 is a chain of 2 "
            r"nodes with up to 1 siblings beside each, 2 to 4 nodes",
        ),
        (["rollout.eos_id=256"], r"rollout.eos_id=256 is not a token of the vocabulary of size"),
        (["rollout.top_p=0"], r"rollout.top_p=0.0 must be in \(0, 1\]"),
        (["rollout.buckets=[{rows: 2}, {rows: 4}]"], r"buckets rows=\[2, 4\] must decrease"),
        (["rl.draft_rows=99"], r"rl.draft_rows=99 must be in \[0, "),
        (["rl.task.spread_decay=0"], r"rl.task.spread_decay=0.0 must be in \(0, 1\]"),
        (
            ["rollout.buckets=[{rows: 4, tree: {kind: chain, depth: 0}}]"],
            r"rollout.buckets\[0\].tree.depth=0 must be >= 1",
        ),
        (["model.hidden_size=0"], r"model.hidden_size=0 must be positive"),
        (["model.dtype=float64"], r"model.dtype='float64' is not one of"),
        (["model.num_layers=abc"], r"model.num_layers='abc' is not int"),
        (["model.num_layers"], r"override 'model.num_layers' has no '='"),
        (["model.head_dim=15"], r"model.head_dim=15 must be even"),
        (
            ["model.rope_scaling.low_freq_factor=4.0", "model.rope_scaling.high_freq_factor=4.0"],
            r"high_freq_factor=4.0 must exceed low_freq_factor=4.0",
        ),
        (["model.rope_scaling.factor=-1"], r"factor, low_freq_factor and .* must be > 0"),
        (["rl.max_grad_norm=-1"], r"rl.max_grad_norm=-1.0 must be > 0"),  # else gradient ascent
        (["rl.draft_max_grad_norm=0"], r"rl.draft_max_grad_norm=0.0 must be > 0"),
        (["rl.keep_checkpoints=0"], r"rl.keep_checkpoints=0 must be >= 1"),
        (["rl.vocab_chunks=0"], r"rl.vocab_chunks=0 must be >= 1"),
        (["rl.vocab_chunks=7"], r"rl.vocab_chunks=7 does not divide the vocabulary of 256 ids"),
        (["model.rope_theta=-1"], r"model.rope_theta=-1.0 must be a finite number > 0"),
        (["model.rms_norm_eps=0"], r"model.rms_norm_eps=0.0 must be a finite number > 0"),
        (["rl.learning_rate=.inf"], r"rl.learning_rate=inf must be > 0 and finite"),
        (["model.hidden_size=["], r"override 'model.hidden_size=\[' is not valid YAML"),
        (["rl.task.shifted_difficulty=3"], r"shifted_difficulty is set but rl.task.shift_step=0"),
        (  # the warm start's 5 rows, and a step's 3 packed ones, cut into no 2 microbatches
            ["pipeline.stages=2", "mesh.stage=2", "pipeline.microbatches=2", "rl.sft_batch=20"],
            r"5 training rows do not cut into pipeline.microbatches=2",
        ),
        (
            ["pipeline.stages=2", "mesh.stage=2", "pipeline.microbatches=2", "rl.packed_rows=[3]"],
            r"3 training rows do not cut into pipeline.microbatches=2",
        ),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load("tiny", overrides)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'nope' not found .* one of: .*tiny"):
        config.load("nope")
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "absent.yaml")


def test_a_config_file_that_is_not_sections_is_named(tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  num_layers: 2\n hidden_size: 8\n")
    with pytest.raises(ConfigError, match=r"config .*bad.yaml is not valid YAML"):
        config.load(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- model\n- rl\n")
    with pytest.raises(ConfigError, match=r"list.yaml holds a list, not sections"):
        config.load(tmp_path / "list.yaml")


def test_mesh_from_config_and_devices():
    m = mesh.make_mesh(MeshConfig(data=-1, tensor=4))
    assert dict(m.shape) == {"data": 2, "stage": 1, "context": 1, "tensor": 4}
    assert mesh.mesh_shape(MeshConfig(data=2, context=2, tensor=2), 8)["stage"] == 1


@pytest.mark.parametrize(
    "cfg, message",
    [
        (MeshConfig(data=3, tensor=2), r"needs 6 devices but 8 are present"),
        (MeshConfig(data=-1, tensor=3), r"the fixed axes use 3, which does not divide 8"),
        (MeshConfig(data=-1, context=-1), r"are all -1"),
        (MeshConfig(data=0), r"mesh.data=0 must be a positive size"),
    ],
)
def test_mesh_that_does_not_fit_is_named(cfg, message):
    with pytest.raises(ConfigError, match=message):
        mesh.make_mesh(cfg, jax.devices())


def test_logical_rules():
    assert mesh.logical_spec(("batch", "seq", "act_heads")) == jax.sharding.PartitionSpec(
        "data", "context", "tensor"
    )
    with pytest.raises(KeyError, match="no rule"):
        mesh.logical_spec(("nonsense",))
