"""Which draft tree a speculative step should verify at a batch size: speculation that never loses.

A step that drafts and verifies a tree costs `c` plain decode steps and a row emits `L` tokens in it
on average (its mean accepted length, the root's token included, times the share of steps the row
is busy: rows finish unevenly, and one with nothing left to do idles); plain decoding is the tree
of no nodes, c = 1 and L its own busy share (1 when every row works to the end). Speculation pays
where L / c beats plain decoding's L. Verification is memory-bound at small batches (c near 1
whatever the tree) and compute-bound at large ones (c grows with batch x nodes), so the best tree
shrinks as the batch grows, down to a chain or to no tree at all, as FastGRPO found at high
concurrency. `choose_tree` takes the candidate of largest L / c, plain decoding always among them,
so by its own measurements the choice is never slower than plain decoding.

The costs are measured per batch size by `jspec/bench/rollout.py` (read its JSON with
`StepCosts.from_bench`) and interpolated in log2(batch) between measured sizes; tokens per row-step
come from rollouts (`RolloutStats.tokens_per_row_step`), which drift as policy and draft train:
`TreeChooser` keeps a running estimate per tree and picks again before every rollout batch. A tree's
acceptance depends on the temperature (at 1 an argmax tree accepts less than half the tokens a tree
drawn from the draft accepts), so a chooser takes its priors only from a bench run at the
rollout's own temperature.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping

import numpy as np

from jspec.config import ConfigError, TreeConfig


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Cost of one speculative step, in plain decode steps, of each tree at measured batch sizes."""

    batches: tuple[int, ...]  # increasing
    cost: Mapping[str, tuple[float, ...]]  # tree name -> cost at each of `batches`

    def __post_init__(self):
        if not self.batches or list(self.batches) != sorted(set(self.batches)):
            raise ConfigError(f"StepCosts.batches={self.batches} must be increasing and not empty.")
        for name, costs in self.cost.items():
            if len(costs) != len(self.batches):
                raise ConfigError(
                    f"tree {name!r} has {len(costs)} costs for {len(self.batches)} batch sizes."
                )

    def at(self, tree: str, batch: int) -> float:
        """The cost at `batch`, interpolated in log2(batch); the nearest measured end outside."""
        if tree not in self.cost:
            raise ConfigError(f"no measured cost for tree {tree!r}; measured: {sorted(self.cost)}.")
        x = [math.log2(b) for b in self.batches]
        return float(np.interp(math.log2(batch), x, self.cost[tree]))

    @classmethod
    def from_bench(cls, path: str | pathlib.Path) -> StepCosts:
        """The costs in a JSON written by `jspec/bench/rollout.py` (its rows' `speculative`)."""
        return cls.from_rows(json.loads(pathlib.Path(path).read_text())["rows"])

    @classmethod
    def from_rows(cls, rows: list[dict]) -> StepCosts:
        """The costs in the rows of `jspec/bench/rollout.py`'s JSON."""
        rows = sorted(rows, key=lambda r: r["batch"])
        trees = set.intersection(*(set(r["speculative"]) for r in rows))
        cost = {t: tuple(r["speculative"][t]["step_in_decode_steps"] for r in rows) for t in trees}
        return cls(tuple(r["batch"] for r in rows), cost)


def choose_tree(
    costs: StepCosts, batch: int, accepted: Mapping[str, float], plain: float = 1.0
) -> tuple[str | None, float]:
    """(tree, predicted speedup over plain decoding) of the candidate with the largest accepted
    length over cost at `batch`; (None, 1.0), plain decoding, when no tree beats it.

    `accepted`: tokens a row emits per step with each candidate tree (mean accepted length x
    busy; trees without one are not candidates); `plain`: those of plain decoding (its busy).
    """
    tree, gain = best_tree(costs, batch, accepted)
    return (tree, gain / plain) if gain > plain else (None, 1.0)


def best_tree(
    costs: StepCosts, batch: int, accepted: Mapping[str, float]
) -> tuple[str | None, float]:
    """(tree, accepted length over cost) of the candidate with the largest such ratio at `batch`,
    whether or not it beats plain decoding; (None, 0.0) without candidates."""
    best, gain = None, 0.0
    for tree, length in sorted(accepted.items()):
        if (ratio := length / costs.at(tree, batch)) > gain:
            best, gain = tree, ratio
    return best, gain


class TreeChooser:
    """The tree of each rollout batch: `choose_tree` on measured costs and running tokens per
    row-step.

    A tree's estimate starts at its tokens per row-step in the bench (its prior; plain decoding's,
    its busy share, under None, 1 if absent) and moves towards what the rollouts that use it
    measure (an exponential average, weight `decay` on the past). Only the tree in use is
    measured, so while plain decoding is chosen the trees' estimates stand still: every
    `probe_every`-th pick then takes the best tree anyway, to measure it again.
    """

    def __init__(
        self,
        costs: StepCosts,
        trees: Mapping[str, TreeConfig],
        prior: Mapping[str | None, float],
        *,
        decay: float = 0.8,
        probe_every: int = 20,
    ):
        missing = set(trees) - set(costs.cost)
        if missing:
            raise ConfigError(
                f"trees {sorted(missing)} have no measured cost; measured: {sorted(costs.cost)}."
            )
        self.costs, self.trees = costs, dict(trees)
        self.decay, self.probe_every = decay, probe_every
        self.estimate = {name: float(prior[name]) for name in trees}
        self.plain = float(prior.get(None, 1.0))  # plain decoding's tokens per row-step
        self._plain_picks = 0

    @classmethod
    def from_bench(cls, path: str | pathlib.Path, temperature: float, **kw) -> TreeChooser:
        """Costs, trees and priors (accepted length x busy, the mean over the batch sizes; plain
        decoding's busy under None) from a JSON of `jspec/bench/rollout.py` that timed
        speculative steps at `temperature`, the rollouts' own."""
        if not pathlib.Path(path).is_file():
            raise ConfigError(
                f"rl.tree_costs={str(path)!r} is not a file: write one with `python -m "
                "jspec.bench.rollout` on the rollout machine, or unset rl.tree_costs."
            )
        data = json.loads(pathlib.Path(path).read_text())
        if not data.get("trees") or not all(r["speculative"] for r in data["rows"]):
            raise ConfigError(
                f"{path} holds no timed speculative steps; run `python -m jspec.bench.rollout` "
                "without --no-spec (and with a trained draft) to write one."
            )
        measured = data.get("args", {}).get("temperature")
        if measured is None or float(measured) != float(temperature):
            raise ConfigError(
                f"rl.tree_costs={str(path)!r} measured its trees' acceptance at temperature "
                f"{'(not recorded)' if measured is None else measured}, but "
                f"rollout.temperature={temperature}: acceptance depends on the "
                f"temperature; measure at it with `python -m jspec.bench.rollout --trained RUN "
                f"--temperature {temperature}` on the rollout machine."
            )
        tuples = lambda fields: {
            k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()
        }
        trees = {name: TreeConfig(**tuples(f)) for name, f in data["trees"].items()}
        for r in data["rows"]:
            if missing := set(trees) - set(r["speculative"]):
                raise ConfigError(f"{path}: batch {r['batch']} has no step of {sorted(missing)}.")
        per_row_step = lambda x: x["accepted_length"] * x.get("busy", 1.0)
        prior = {
            t: float(np.mean([per_row_step(r["speculative"][t]) for r in data["rows"]]))
            for t in trees
        }
        prior[None] = float(np.mean([r.get("busy", 1.0) for r in data["rows"]]))
        return cls(StepCosts.from_rows(data["rows"]), trees, prior, **kw)

    def pick_tree(self, batch: int) -> tuple[str, TreeConfig]:
        """(name, tree) of the tree that pays most at `batch` rows, plain decoding no candidate: a
        bucket's, whose rows speculate as the rows before them did."""
        name, _ = best_tree(self.costs, batch, self.estimate)
        return name, self.trees[name]

    def pick(self, batch: int) -> tuple[str | None, TreeConfig | None]:
        """(name, tree) for a batch of `batch` rows; (None, None): plain decoding."""
        name, _ = choose_tree(self.costs, batch, self.estimate, self.plain)
        if name is None:
            self._plain_picks += 1
            if self._plain_picks % self.probe_every:
                return None, None
            name, _ = best_tree(self.costs, batch, self.estimate)
        return name, self.trees[name]

    def dumps(self) -> bytes:
        """What the rollouts taught it (estimates, plain picks), as JSON: kept beside a
        checkpoint, so that the resumed run picks the trees the uninterrupted one would."""
        learnt = dict(estimate=self.estimate, plain=self.plain, plain_picks=self._plain_picks)
        return json.dumps(learnt).encode()

    def resume(self, path: pathlib.Path) -> None:
        """Takes up what a `dumps` saved at `path` taught (the estimates of the trees it also
        has), if it is there."""
        if not path.is_file():
            return
        learnt = json.loads(path.read_text())
        self.estimate |= {n: float(e) for n, e in learnt["estimate"].items() if n in self.trees}
        self.plain, self._plain_picks = float(learnt["plain"]), int(learnt["plain_picks"])

    def observe(self, name: str | None, tokens_per_row_step: float) -> None:
        """The tokens per row-step the rollouts of tree `name` (None: plain decoding) measured."""
        old = self.plain if name is None else self.estimate[name]
        new = self.decay * old + (1 - self.decay) * tokens_per_row_step
        if name is None:
            self.plain = new
        else:
            self.estimate[name] = new
