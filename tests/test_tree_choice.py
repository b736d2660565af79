"""Choosing the tree per batch size: the most tokens per row-step over cost, plain decoding when no
tree pays, costs interpolated in log2(batch) and read from bench_rollout's JSON."""

import dataclasses
import json

import pytest

from jspec.config import ConfigError, TreeConfig
from jspec.sampler.tree_choice import StepCosts, TreeChooser, choose_tree

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


def bench_json(path, trees, accepted, busy=None, temperature=1.0):
    """A bench_rollout JSON over COSTS' batches at `temperature`: the trees' fields and, per batch,
    each tree's cost, accepted length and share of busy row-steps (`busy`, 1 by default)."""
    busy = busy or {}
    step = lambda t, i: {
        "step_in_decode_steps": COSTS.cost[t][i],
        "accepted_length": accepted[t],
        "busy": busy.get(t, 1.0),
    }
    rows = [
        {"batch": b, "speculative": {t: step(t, i) for t in trees}}
        for i, b in enumerate(COSTS.batches)
    ]
    fields = {t: dataclasses.asdict(tree) for t, tree in trees.items()}
    args = {"temperature": temperature}
    path.write_text(json.dumps({"args": args, "trees": fields, "rows": rows}))
    return path


TREES = {
    "chain": TreeConfig(kind="chain", depth=4, sampled=False),
    "dynamic": TreeConfig(kind="static", parents=(-1, -1, 0), sampled=False),
}


def test_chooser_follows_the_measured_acceptance(tmp_path):
    chooser = TreeChooser.from_bench(bench_json(tmp_path / "b.json", TREES, ACCEPTED), 1.0)
    assert chooser.pick(1) == ("dynamic", TREES["dynamic"])  # the tree (a tuple) comes back whole
    assert chooser.pick(64) == ("chain", TREES["chain"])
    for _ in range(10):  # the dynamic tree accepts less than the bench said: the chain wins at 1
        chooser.observe("dynamic", 2.0)
    assert chooser.pick(1)[0] == "chain"
    chooser.observe(None, 0.5)  # plain decoding's rows idle half the time: it moves only itself
    assert chooser.estimate == pytest.approx({"chain": 2.5, "dynamic": 2.0 + 1.2 * 0.8**10})
    assert chooser.plain == pytest.approx(0.9)


def test_rows_that_idle_count_against_a_tree(tmp_path):
    """A tree whose rows finish unevenly (half their steps idle) loses to one that accepts less;
    plain decoding's idle rows count against it too."""
    path = bench_json(tmp_path / "b.json", TREES, ACCEPTED, busy={"dynamic": 0.5})
    chooser = TreeChooser.from_bench(path, 1.0)
    assert chooser.estimate == pytest.approx({"chain": 2.5, "dynamic": 1.6})
    assert chooser.pick(1)[0] == "chain"
    assert choose_tree(COSTS, 256, ACCEPTED) == (None, 1.0)
    assert choose_tree(COSTS, 256, ACCEPTED, plain=0.5) == ("chain", pytest.approx(2.5 / 3 / 0.5))


def test_chooser_decodes_plainly_where_no_tree_pays_and_probes(tmp_path):
    chooser = TreeChooser.from_bench(bench_json(tmp_path / "b.json", TREES, ACCEPTED), 1.0)
    chooser.probe_every = 3
    picks = [chooser.pick(256)[0] for _ in range(6)]
    assert picks == [None, None, "chain", None, None, "chain"]  # 2.5 / 3.0 beats 3.2 / 6.0


def test_a_chooser_resumed_from_what_it_saved_picks_what_it_would_have(tmp_path):
    """What the rollouts taught a chooser (its estimates, and where it is in its probing of the
    trees while decoding plainly) saved and taken up by a fresh one: the same picks after."""
    path = bench_json(tmp_path / "b.json", TREES, ACCEPTED)
    chooser, resumed = (TreeChooser.from_bench(path, 1.0) for _ in range(2))
    for _ in range(10):
        chooser.observe("dynamic", 2.0)
    chooser.observe(None, 0.5)
    chooser.pick(256)  # the first of probe_every plain picks
    saved = tmp_path / "trees" / "3.json"
    saved.parent.mkdir()
    saved.write_bytes(chooser.dumps())
    resumed.resume(tmp_path / "trees" / "2.json")  # none saved there: the bench's priors stand
    assert resumed.estimate == pytest.approx(ACCEPTED)
    resumed.resume(saved)
    picks = lambda c: [c.pick(b)[0] for b in (1, 64, 256) * 30]
    assert resumed.estimate == chooser.estimate and picks(resumed) == picks(chooser)


def test_chooser_needs_a_bench_of_speculative_steps(tmp_path):
    with pytest.raises(ConfigError, match="rl.tree_costs='.*missing.json' is not a file"):
        TreeChooser.from_bench(tmp_path / "missing.json", 1.0)
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"trees": {}, "rows": [{"batch": 1, "speculative": {}}]}))
    with pytest.raises(ConfigError, match="holds no timed speculative steps"):
        TreeChooser.from_bench(path, 1.0)
    bench = json.loads(bench_json(path, TREES, ACCEPTED).read_text())
    del bench["rows"][1]["speculative"]["chain"]
    path.write_text(json.dumps(bench))
    with pytest.raises(ConfigError, match=r"batch 64 has no step of \['chain'\]"):
        TreeChooser.from_bench(path, 1.0)


def test_costs_measured_at_another_temperature_are_refused(tmp_path):
    """Acceptance depends on the temperature: greedy figures are no prior for RL's sampling."""
    path = bench_json(tmp_path / "b.json", TREES, ACCEPTED, temperature=0.0)
    with pytest.raises(ConfigError, match=r"at temperature 0.0, but rollout.temperature=1.0"):
        TreeChooser.from_bench(path, 1.0)
    assert TreeChooser.from_bench(path, 0.0).pick(1)[0] == "dynamic"


def test_a_bucket_takes_the_tree_that_pays_most_even_where_plain_decoding_would_win(tmp_path):
    """`pick_tree`: a bucket's rows speculate as the rows before them did, so plain decoding is
    no candidate there."""
    chooser = TreeChooser.from_bench(bench_json(tmp_path / "b.json", TREES, ACCEPTED), 1.0)
    assert chooser.pick(256)[0] is None
    assert chooser.pick_tree(256) == ("chain", TREES["chain"])
    assert chooser.pick_tree(1)[0] == "dynamic"
