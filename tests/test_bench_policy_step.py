"""`jspec/bench/policy_step.py`: its model FLOPs against XLA's own count of the compiled program
(an independent reference: XLA's cost analysis adds every op's FLOPs, so it sits a little above
the model's products and visible attention), and a run on the CPU; the split of
the RL train step (`jspec/bench/train_step.py`) into optimizer, policy and draft."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jspec import config as config_lib
from jspec.bench import policy_step, train_step
from jspec.config import ConfigError
from jspec.models import create

# One layer: XLA's cost analysis counts a scanned loop's body once. Wide enough that the
# products dominate the norms, rotations and softmax XLA counts beside them.
SHAPE = [
    "model.num_layers=1",
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "model.head_dim=64",
    "model.vocab_size=1024",
    "model.remat=none",
]


def xla_flops(fn, *inputs) -> float:
    analysis = jax.jit(fn).lower(*inputs).compile().cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


@pytest.mark.parametrize("documents", [1, 4])
def test_model_flops_are_what_xla_counts_within_4_percent(documents):
    cfg = config_lib.load("tiny", SHAPE).model
    graphdef, params = nnx.split(create(cfg))
    ids, seg, pos = policy_step.packed_rows(cfg, 2, 64, documents)
    forward = lambda p, t, s, q: nnx.merge(graphdef, p)(t, s, q)
    model = policy_step.model_flops(cfg, seg, pos)
    assert np.isclose(xla_flops(forward, params, ids, seg, pos), model / 3, rtol=0.04)
    backward = policy_step.gradient_fn(graphdef)
    assert np.isclose(xla_flops(backward, params, ids, seg, pos), model, rtol=0.04)


def test_a_mixture_counts_its_routed_experts_and_router_only():
    dense = config_lib.load("tiny", SHAPE).model
    moe = config_lib.load(
        "tiny",
        [*SHAPE, "model.num_experts=8", "model.num_experts_per_tok=2"]
        + ["model.moe_intermediate_size=512"],
    ).model
    _, seg, pos = policy_step.packed_rows(dense, 1, 64, 1)
    h, f = dense.hidden_size, dense.intermediate_size
    expected = 3 * 64 * (6 * h * 512 * 2 + 2 * h * 8 - 6 * h * f)
    difference = policy_step.model_flops(moe, seg, pos) - policy_step.model_flops(dense, seg, pos)
    assert difference == expected


def test_the_benchmark_runs_and_names_tokens_that_do_not_split_into_documents(tmp_path, capsys):
    out = tmp_path / "policy.json"
    argv = ["--device", "cpu", "--config", "tiny", "--tokens", "64", "--documents", "2"]
    policy_step.main([*argv, "--iters", "1", "--out", str(out), "model.num_layers=2"])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 64 and row["ms"] > 0 and 0 < row["of_ceiling"] < 1
    assert "| 64 | 1 | 1 |" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--tokens 63 is not a multiple of --documents 2"):
        policy_step.parse_args(["--tokens", "63", "--documents", "2"])
    with pytest.raises(ConfigError, match="--vocab-chunks 7 does not divide the vocabulary of 256"):
        policy_step.main([*argv, "--vocab-chunks", "4", "7"])


def test_the_rl_train_step_splits_into_optimizer_policy_and_draft():
    """`jspec/bench/train_step.py`'s split: a step less its optimizer update is its forward and
    backward; the draft's part is what co-training adds to the policy's."""
    timed = {
        "none": dict(seconds=1.0, optimizer=0.2, rows=8, policy_flops=8e11),
        "cotrain, 3 TTT steps": dict(seconds=1.3, optimizer=0.25, rows=8, policy_flops=8e11),
    }
    rows, policy = train_step.split(timed)
    assert [r["forward_backward"] for r in rows] == pytest.approx([0.8, 1.05])
    assert [r["draft"] for r in rows] == pytest.approx([0.0, 0.25])
    assert rows[1]["over_none"] == pytest.approx(1.3)
    assert policy["tflop_per_s"] == pytest.approx(1.0)


def test_the_rl_train_step_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "train_step.json"
    argv = ["--config", "demo", "--ttt-steps", "1", "--steps", "1", "--prompt-len", "16"]
    train_step.main([*argv, "--mean-response", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["none", "frozen", "cotrain, 1 TTT steps"]
    assert all(0 < r["optimizer"] < r["seconds"] for r in result["rows"])
    assert result["policy"]["tflop"] > 0
    assert "policy forward + backward:" in capsys.readouterr().out


def test_profiled_kernels_are_split_by_what_they_are():
    from collections import Counter

    from jspec.bench.kernel_profile import by_kind

    ms = Counter(
        {
            "nvjet_sm90_tst_176x128_64x5_2x1_v_bz_TNN": 5.0,
            "gemm_fusion_dot_303": 2.0,
            "jspec_attention_mosaic_bwd": 3.0,
            "jspec_decode_trunk__1": 1.0,
            "loop_multiply_fusion_16": 0.5,
        }
    )
    assert by_kind(ms) == {"matmul": 7.0, "attention": 4.0, "other": 0.5}
