"""What `generate` accepts and the rows it decodes in: every argument checked before anything is
traced or compiled (a clear error naming the value and the fix, where a wrong shape or id would
otherwise fail deep inside a compiled loop or pass silently: an embedding lookup clamps an id
outside the vocabulary), and how many rows decode at once, how many a refill fills, and how many
ways the mesh splits them."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jspec import mesh as mesh_lib
from jspec.attention.zigzag import concrete
from jspec.config import ConfigError, RolloutConfig
from jspec.models.block import BlockDraft
from jspec.models.draft import check_target


class Continued(NamedTuple):
    """Completions a rollout goes on with (partial rollouts): each one's prompt followed by the
    tokens it has so far, right-padded, [K, W]; their lengths [K]; and the new tokens each may
    still take [K], at most `max_new_tokens`. Their caches are filled again by the weights the
    rollout runs with, in rows of their own, so fresh prompts keep their narrower width."""

    tokens: Int[Array, "k w"]
    lengths: Int[Array, " k"]
    budgets: Int[Array, " k"]


def check_generate_args(
    target,
    draft,
    prompts,
    prompt_lengths,
    config: RolloutConfig,
    continued=None,
    keep: int = 0,
    budgets=None,
) -> None:
    """Raises a clear error for arguments `generate` cannot run with."""
    config.validate(target.config)
    if draft is not None:
        check_target(draft, target.config)
    for where, tree in config.trees() if isinstance(draft, BlockDraft) else ():
        draft.check_tree(tree, where)
    if getattr(prompts, "ndim", None) != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(
            f"prompts must be an integer array [prompts, tokens], got "
            f"{getattr(prompts, 'dtype', type(prompts))}{getattr(prompts, 'shape', '')}."
        )
    p, t = prompts.shape
    if np.shape(prompt_lengths) != (p,):
        raise ValueError(f"prompt_lengths {np.shape(prompt_lengths)} must be [prompts]=[{p}].")
    total = t + config.max_new_tokens
    if total > target.config.max_seq_len:
        raise ConfigError(
            f"prompts of {t} tokens plus rollout.max_new_tokens={config.max_new_tokens} need a "
            f"cache of {total} slots, more than model.max_seq_len={target.config.max_seq_len}; "
            "shorten the prompts or max_new_tokens."
        )
    shards = row_shards(target.mesh)
    sizes = {name: getattr(config, name) for name in ("rows", "refill_rows")}
    sizes.update({f"buckets[{i}].rows": b.rows for i, b in enumerate(config.buckets)})
    for name, rows in sizes.items():
        if rows % shards:
            raise ConfigError(
                f"rollout.{name}={rows} does not split over the {shards} shards of the rows "
                f"(mesh axes data x context); use a multiple of {shards}."
            )
    why = f"every prompt needs at least one token and at most the {t} columns of `prompts`."
    n = _check_each_in("prompt_lengths", prompt_lengths, 1, t, why)
    if n is not None and concrete(prompts):
        _check_token_ids(np.asarray(prompts), n, target.config.vocab_size)
    rows = decode_rows(config, p + (0 if continued is None else continued.lengths.shape[0]))
    if rows % shards:
        raise ConfigError(
            f"{rows} rows decode at once ({p} prompts, rollout.rows={config.rows}): they do not "
            f"split over the {shards} shards of the rows (mesh axes data x context); pass a "
            f"multiple of {shards} prompts or set rollout.rows to one."
        )
    if not 0 <= keep < rows:
        raise ValueError(f"keep={keep} must be in [0, {rows}): rows left running of the {rows}.")
    if continued is not None:
        _check_continued(continued, rows, t + config.max_new_tokens, config.max_new_tokens)
    if budgets is not None:
        _check_budgets(budgets, p, config.max_new_tokens)


def _check_budgets(budgets, prompts: int, most: int) -> None:
    """One budget of new tokens a prompt, each in [1, max_new_tokens]."""
    if np.shape(budgets) != (prompts,):
        raise ValueError(f"budgets {np.shape(budgets)} must be [prompts]=[{prompts}].")
    why = f"a completion takes at least one new token and at most rollout.max_new_tokens={most}."
    _check_each_in("budgets", budgets, 1, most, why)


def _check_each_in(name: str, values, low: int, high: int, why: str) -> np.ndarray | None:
    """`values` on the host (None while traced), each in [low, high]: else an error naming the
    first outside and `why`."""
    if not concrete(values):
        return None
    n = np.asarray(values)
    bad = np.flatnonzero((n < low) | (n > high))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}]={n[bad[0]]} is outside [{low}, {high}]: {why}")
    return n


def _check_token_ids(prompts: np.ndarray, lengths: np.ndarray, vocab: int) -> None:
    """Every prompt token (the first `lengths` columns of its row) is an id of the vocabulary: an
    embedding lookup would clamp one outside it without a word."""
    outside = (np.arange(prompts.shape[1]) < lengths[:, None]) & (
        (prompts < 0) | (prompts >= vocab)
    )
    if outside.any():
        i, j = np.argwhere(outside)[0]
        raise ValueError(
            f"prompts[{i}, {j}]={prompts[i, j]} is not a token id of the model's vocabulary "
            f"[0, {vocab}); encode prompts with the model's tokenizer."
        )


def _check_continued(continued: Continued, rows: int, slots: int, budget: int) -> None:
    """Continued completions fit the rows and the caches of `slots` tokens (prompt width + max new
    tokens), each with a budget in [1, max_new_tokens]."""
    k, w = continued.tokens.shape
    if continued.lengths.shape != (k,) or continued.budgets.shape != (k,):
        raise ValueError(
            f"continued: lengths {continued.lengths.shape} and budgets {continued.budgets.shape} "
            f"must be [{k}], one per row of its tokens {continued.tokens.shape}."
        )
    if k > rows:
        raise ValueError(f"{k} continued completions need as many rows; {rows} decode at once.")
    if w >= slots:
        raise ValueError(f"continued tokens of {w} columns leave no room in caches of {slots}.")
    if concrete(continued.lengths) and concrete(continued.budgets):
        n, left = np.asarray(continued.lengths), np.asarray(continued.budgets)
        bad = np.flatnonzero((n < 1) | (n > w) | (left < 1) | (left > budget) | (n + left > slots))
        if bad.size:
            i = bad[0]
            raise ValueError(
                f"continued[{i}]: length {n[i]} and budget {left[i]} must be in [1, {w}] and "
                f"[1, {budget}] (max_new_tokens), together at most the caches' {slots} slots."
            )


def decode_rows(config: RolloutConfig, prompts: int) -> int:
    """Rows decoded at once: `config.rows`, at most one per prompt (0: every prompt)."""
    return min(config.rows or prompts, prompts)


def refill_rows(config: RolloutConfig, rows: int, prompts: int, mesh) -> int:
    """Prompts prefilled together: `config.refill_rows`; else every row at once when no prompt
    waits for a row, or a row in 8 rounded up to the row shards (a refill's rows split as the rows
    do)."""
    shards = row_shards(mesh)
    chunk = config.refill_rows or (
        rows if rows == prompts else -(-max(1, rows // 8) // shards) * shards
    )
    return min(chunk, rows)


def row_shards(mesh) -> int:
    """How many ways a rollout's rows are split: the mesh axes of `decode_batch`."""
    return 1 if mesh is None else mesh_lib.axis_size(mesh, "decode_batch")
