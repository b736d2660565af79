"""What `generate` returns: the completions, with the log-probabilities the policy loss needs,
and the acceptance statistics that the tree chooser and the benchmarks read."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jaxtyping import Array, Bool, Float, Int


class RolloutStats(NamedTuple):
    """Acceptance statistics of one `generate` call.

    steps [P]: target forwards after the prefill while the prompt's row was active (verify steps).
    accepted [P]: draft tokens accepted and emitted.
    reached_depth [D]: over all rows and steps, how many accepted paths reached depth d = 1..D.
    accepted_non_first [P]: accepted nodes that were not their parent's first child (siblings
      earn their place only through these).
    failed [P]: prompts whose results must not be used (a prompt length out of range, or a cache
      overflow, possible only when `rollout` is traced with unknown lengths).
    iterations []: verify steps of the loop, active rows or not (a step costs the same either way).
    row_steps [S]: rows decoded, summed over the iterations of each stage (`stages`: the batch
      decoded at once, then each bucket below it; fewer than rows x iterations once the live rows
      are compacted into a smaller bucket).
    emitted [S]: tokens emitted in each stage, over all rows.
    """

    steps: Int[Array, " p"]
    accepted: Int[Array, " p"]
    reached_depth: Int[Array, " d"]
    accepted_non_first: Int[Array, " p"]
    failed: Bool[Array, " p"]
    iterations: Int[Array, ""]
    row_steps: Int[Array, " s"]
    emitted: Int[Array, " s"]

    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step, 1 + accepted / steps, over all rows."""
        steps = int(np.sum(self.steps))
        return 1.0 + int(np.sum(self.accepted)) / max(steps, 1)

    def busy(self) -> float:
        """The share of the rows' steps in which they emitted (a row idles once it is done and no
        prompt waits for it)."""
        return int(np.sum(self.steps)) / max(int(np.sum(self.row_steps)), 1)

    def tokens_per_row_step(self, stage: int | None = None) -> float:
        """Tokens a row emits per loop step, idle steps counted: what speculation gains per row
        over plain decoding's at most 1 (mean accepted length x busy), over the rollout or over
        one of its `stages`."""
        if stage is None:
            return self.mean_accepted_length() * self.busy()
        return int(self.emitted[stage]) / max(int(self.row_steps[stage]), 1)

    def acceptance_per_depth(self) -> np.ndarray:
        """Fraction of verify steps whose accepted path reached each depth."""
        return np.asarray(self.reached_depth) / max(int(np.sum(self.steps)), 1)


class Rollout(NamedTuple):
    """Generated completions, one per prompt (the continued ones after them): tokens [P,M] (-1
    after each one's length), lengths [P] (an EOS included), log-probabilities [P,M] (0 after the
    length), whether each one ended (at EOS or its budget; False only for the rows still running
    when a rollout with `keep` returned) and statistics."""

    tokens: Int[Array, "p m"]
    lengths: Int[Array, " p"]
    logprobs: Float[Array, "p m"]
    finished: Bool[Array, " p"]
    stats: RolloutStats
