"""Partial rollouts (`rl.partial_rows` = K): a step's rollout returns once at most K of its rows
still run; those completions go on in the next step's rollout beside its own prompts, and a group
trains in the step in which its last completion ends.

Why: a step's rollout lasts as long as its longest completion, and in RL a few run far longer than
most (the long tail: rows idle, or a small bucket decodes alone). With partial rollouts no step
waits for its tail: the longest completions finish in rows of the next step's batch.

How the trainer treats them: a carried completion goes on from its prompt and its tokens so far,
its caches filled again by the next rollout's weights (`jspec.sampler.Continued`: one prefill of
K rows), so one completion's tokens may come from several policy versions. Each token's version
is recorded, and the policy loss weighs it, as every token, by the clipped ratio of the current
policy's probability to the one it was sampled with (its recorded log-probability), as it weighs
the stale rollouts of `rl.max_lag`; the metrics' `token_lag` is the trained tokens' mean age in
steps. Groups are never split: a group's finished completions wait until its last one ends, so
its advantages compare whole answers; a step trains on a varying number of groups (at most
rl.prompts + K).

What it costs: the rollout decodes K rows more than the batch (placeholders of one token where
fewer are carried) and prefills K rows of prompt + max_new_tokens; a step trains on a batch's
worth of sequences, or on room for K more groups in steps that complete more (a second compiled
train step). A completion is carried until it ends, at least a token a step, so its oldest
tokens may be up to max_new_tokens steps old (not bounded by rl.max_lag). `jspec.jobs.plan` does
not count the extra rows.

The `Pool` (the completions of groups not yet trained) belongs to the sampler's thread, which
updates it after each rollout in step order (rollouts of later steps may run ahead of the
trainer); a copy of it after each rollout goes with the checkpoint of the step that follows, so a
resumed run carries the same completions on.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
from typing import Any

import jax
import numpy as np

from jspec.config import ConfigError, RolloutConfig
from jspec.sampler import Continued, Rollout, generate


@dataclasses.dataclass
class Completion:
    """One response of a group not yet trained: its prompt, its tokens so far with their
    log-probabilities and the policy version (train steps) that sampled each."""

    step: int  # the RL step whose prompts it answers
    group: int  # its group in that step
    problem: Any
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finished: bool

    def extend(self, tokens, logprobs, version: int, finished: bool) -> None:
        self.tokens = np.concatenate([self.tokens, tokens])
        self.logprobs = np.concatenate([self.logprobs, logprobs])
        self.versions = np.concatenate([self.versions, np.full(len(tokens), version, np.int32)])
        self.finished = finished


@dataclasses.dataclass
class Trained:
    """The completions a step trains on (whole groups, in order) as the packer takes them."""

    problems: list
    steps: list[int]
    prompts: np.ndarray  # [n, prompt width], right-padded
    prompt_lengths: np.ndarray
    tokens: np.ndarray  # [n, max_new_tokens], right-padded with -1
    lengths: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray | None = None  # [n, max_new_tokens]: each token's version (-1 after)


class Pool:
    """The completions of groups not yet trained, of at most `rows` unfinished ones; prompts of
    up to `prompt_width` tokens and responses of up to `max_new_tokens`."""

    def __init__(self, rows: int, prompt_width: int, max_new_tokens: int, group_size: int):
        self.rows, self.prompt_width, self.max_new = rows, prompt_width, max_new_tokens
        self.group_size = group_size
        self.pending: list[Completion] = []

    def unfinished(self) -> list[Completion]:
        """The completions still running, in the order of the next rollout's continued rows."""
        return [c for c in self.pending if not c.finished]

    def continued(self) -> Continued:
        """The unfinished completions as the next rollout's continued rows (numpy): `rows` rows
        of the widest prefix there can be, the rows past them of one token and a budget of one
        (they end at their first token)."""
        width = self.prompt_width + self.max_new - 1
        tokens = np.zeros((self.rows, width), np.int32)
        lengths, budgets = np.ones(self.rows, np.int32), np.ones(self.rows, np.int32)
        for j, c in enumerate(self.unfinished()):
            prefix = np.concatenate([c.prompt, c.tokens])
            tokens[j, : len(prefix)], lengths[j] = prefix, len(prefix)
            budgets[j] = self.max_new - len(c.tokens)
        return Continued(tokens, lengths, budgets)

    def rollout(
        self,
        args: tuple,
        config: RolloutConfig,
        step: int,
        version: int,
        problems,
        prompts,
        prompt_lengths,
        place=lambda arrays: arrays,
    ) -> tuple[Rollout, Trained, int]:
        """`generate(*args, config)` (args: policy, draft, prompts, lengths, key) of step `step`
        by weights `version`, with the unfinished completions continued beside its prompts
        (`place` puts their arrays on the devices) and at most `rows` left running; the rollout,
        the groups now complete (`add`; `problems`, `prompts` and `prompt_lengths` on the host)
        and the tokens it generated (not the idle rows')."""
        continued = Continued(*place(tuple(self.continued())))
        out = generate(*args, config, continued=continued, keep=self.rows)
        host = jax.device_get((out.tokens, out.lengths, out.logprobs, out.finished))
        generated = int(host[1][: len(problems) + len(self.unfinished())].sum())
        return out, self.add(step, version, problems, prompts, prompt_lengths, host), generated

    def add(self, step: int, version: int, problems, prompts, prompt_lengths, out) -> Trained:
        """Takes a rollout's host outputs `out` (tokens, lengths, logprobs, finished: the
        prompts' rows, then `continued`'s) of step `step` sampled by weights `version`; returns
        the groups now complete, taken out of the pool."""
        tokens, lengths, logprobs, finished = out
        p, carried = len(problems), self.unfinished()
        for i in range(p):
            n = int(lengths[i])
            prompt = np.asarray(prompts[i, : prompt_lengths[i]], np.int32)
            c = Completion(step, i // self.group_size, problems[i], prompt, *_empty(), False)
            c.extend(tokens[i, :n], logprobs[i, :n], version, bool(finished[i]))
            self.pending.append(c)
        for j, c in enumerate(carried):
            n = int(lengths[p + j])
            c.extend(tokens[p + j, :n], logprobs[p + j, :n], version, bool(finished[p + j]))
        groups: dict[tuple[int, int], list[Completion]] = {}
        for c in self.pending:
            groups.setdefault((c.step, c.group), []).append(c)
        done = [g for g in groups.values() if all(c.finished for c in g)]
        taken = {id(c) for g in done for c in g}
        self.pending = [c for c in self.pending if id(c) not in taken]
        unfinished = len(self.unfinished())
        assert unfinished <= self.rows, f"{unfinished} unfinished completions past {self.rows}"
        return self._trained([c for g in done for c in g])

    def _trained(self, completions: list[Completion]) -> Trained:
        n, t, m = len(completions), self.prompt_width, self.max_new
        out = Trained(
            problems=[c.problem for c in completions],
            steps=[c.step for c in completions],
            prompts=np.zeros((n, t), np.int32),
            prompt_lengths=np.asarray([len(c.prompt) for c in completions], np.int32),
            tokens=np.full((n, m), -1, np.int32),
            lengths=np.asarray([len(c.tokens) for c in completions], np.int32),
            logprobs=np.zeros((n, m), np.float32),
            versions=np.full((n, m), -1, np.int32),
        )
        for i, c in enumerate(completions):
            out.prompts[i, : len(c.prompt)] = c.prompt
            out.tokens[i, : len(c.tokens)] = c.tokens
            out.logprobs[i, : len(c.tokens)] = c.logprobs
            out.versions[i, : len(c.tokens)] = c.versions
        return out

    def snapshot(self) -> bytes:
        return pickle.dumps(self.pending)

    def resume(self, path: pathlib.Path) -> bool:
        """Takes the completions of a `snapshot` saved at `path`; False if there is none (the pool
        stays empty). Raises ConfigError when they do not fit this pool (a run resumed with
        another rl.partial_rows or rollout.max_new_tokens)."""
        if not path.is_file():
            return False
        pending = pickle.loads(path.read_bytes())
        running = [c for c in pending if not c.finished]
        longest = max((len(c.tokens) for c in running), default=0)
        if len(running) > self.rows or longest >= self.max_new:
            raise ConfigError(
                f"{path} carries {len(running)} completions of up to {longest} tokens on, which "
                f"rl.partial_rows={self.rows} and rollout.max_new_tokens={self.max_new} cannot "
                "continue; resume with the values the run was saved with."
            )
        self.pending = pending
        return True


def metrics(trained: Trained, finished, step: int, group_size: int) -> dict:
    """A step's figures of partial rollouts: the rows its rollout left running, the groups it
    trains, and the mean age in steps of the tokens it trains (0: sampled by the weights that
    this step trains)."""
    versions = trained.versions[trained.versions >= 0]
    return {
        "carried_rows": int(np.sum(~np.asarray(finished))),
        "trained_groups": len(trained.problems) // group_size,
        "token_lag": float(np.mean(step - versions)) if versions.size else 0.0,
    }


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32)
