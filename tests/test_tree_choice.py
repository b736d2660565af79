"""Choosing the tree per batch size: the largest accepted length over cost, plain decoding when no
tree pays, costs interpolated in log2(batch) and read from bench_rollout's JSON."""

import json

import pytest

from jspec.config import ConfigError
from jspec.sampler.tree_choice import StepCosts, choose_tree

COSTS = StepCosts((1, 64, 256), {"chain": (1.1, 1.5, 3.0), "dynamic": (1.2, 2.6, 6.0)})
ACCEPTED = {"chain": 2.5, "dynamic": 3.2}


def test_the_tree_shrinks_as_the_batch_grows():
    assert choose_tree(COSTS, 1, ACCEPTED) == ("dynamic", pytest.approx(3.2 / 1.2))
    assert choose_tree(COSTS, 64, ACCEPTED) == ("chain", pytest.approx(2.5 / 1.5))
    assert choose_tree(COSTS, 256, ACCEPTED) == (None, 1.0)  # verification no longer pays
    assert choose_tree(COSTS, 1, {}) == (None, 1.0)


def test_costs_interpolate_in_log_batch_and_clamp():
    assert COSTS.at("chain", 16) == pytest.approx(1.1 + (4 / 6) * 0.4)
    assert COSTS.at("chain", 1024) == 3.0
    with pytest.raises(ConfigError, match="no measured cost for tree 'static'"):
        COSTS.at("static", 1)
    with pytest.raises(ConfigError, match="increasing"):
        StepCosts((64, 1), {})


def test_costs_from_bench_json(tmp_path):
    rows = [
        {
            "batch": b,
            "speculative": {t: {"step_in_decode_steps": c[i]} for t, c in COSTS.cost.items()},
        }
        for i, b in enumerate(COSTS.batches)
    ]
    path = tmp_path / "bench_rollout.json"
    path.write_text(json.dumps({"rows": rows[::-1]}))
    assert StepCosts.from_bench(path) == COSTS
