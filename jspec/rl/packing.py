"""Packed training rows: prompt + response sequences laid end to end, several per row.

Row r holds sequences r * k .. r * k + k - 1 (k = `per_row`), each a document of its own segment
id, padded to a multiple of `align` (2 * cp under context parallelism: the ring's zigzag layout
cuts every document into 2 * cp chunks); the row's tail is padding (segment 0). Per-token arrays
are aligned at the token: `response[j]` says token j was generated, `old_logprobs[j]` is the
sampler's log-probability of token j, `advantages[j]` its sequence's advantage. Shapes are static
(`row_length`), so the train step compiles once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jaxtyping import Array, Bool, Float, Int


class PackedBatch(NamedTuple):
    tokens: Int[Array, "r l"]
    segment_ids: Int[Array, "r l"]
    positions: Int[Array, "r l"]
    response: Bool[Array, "r l"]
    old_logprobs: Float[Array, "r l"]
    advantages: Float[Array, "r l"]
    sequence: Int[Array, "r l"]  # index of the token's sequence in the batch; -1 for padding


def row_length(max_sequence: int, per_row: int, align: int) -> int:
    """Tokens per row: `per_row` documents of up to `max_sequence` tokens, each aligned."""
    return per_row * (-(-max_sequence // align) * align)


def _place(padded: np.ndarray, per_row: int, rows: int | None, length: int):
    """(row, offset, document number in its row) of each sequence of `padded` tokens: sequence i
    in row i // per_row; or, with `rows`, first fit, longest first, into that many rows of
    `length` tokens (None when they do not fit)."""
    b = len(padded)
    if rows is None:
        rows, order = b // per_row, range(b)
        fits = lambda i, cursor: [i // per_row]
    else:
        order = np.argsort(-padded, kind="stable")
        fits = lambda i, cursor: np.flatnonzero(cursor + padded[i] <= length)[:1]
    cursor, docs = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    where = [None] * b
    for i in order:
        row = fits(i, cursor)
        if len(row) == 0:
            return None
        r = int(row[0])
        where[i] = (r, int(cursor[r]), int(docs[r]))
        cursor[r] += padded[i]
        docs[r] += 1
    return where


def pack(
    prompts: np.ndarray,
    prompt_lengths: np.ndarray,
    responses: np.ndarray,
    response_lengths: np.ndarray,
    logprobs: np.ndarray | None = None,
    advantages: np.ndarray | None = None,
    *,
    per_row: int,
    align: int = 1,
    rows: int | None = None,
) -> PackedBatch | None:
    """Packs B sequences (prompt [B,P] + response [B,M], right-padded) into B / per_row rows.

    `logprobs` [B,M] of the responses and `advantages` [B] default to 0 (supervised data). With
    `rows` (fewer than B / per_row), the rows are as long, but the sequences go into that many by
    their real lengths, first fit, longest first (so a row may hold more than per_row of them);
    None when they do not fit.
    """
    prompts, responses = np.asarray(prompts), np.asarray(responses)
    b, p = prompts.shape
    m = responses.shape[1]
    if b % per_row:
        raise ValueError(f"{b} sequences do not fill rows of per_row={per_row}; pass a multiple.")
    logprobs = np.zeros((b, m), np.float32) if logprobs is None else np.asarray(logprobs)
    advantages = np.zeros((b,), np.float32) if advantages is None else np.asarray(advantages)
    length = row_length(p + m, per_row, align)
    lengths = np.asarray(prompt_lengths, np.int64) + np.asarray(response_lengths, np.int64)
    where = _place(-(-lengths // align) * align, per_row, rows, length)
    if where is None:
        return None
    rows = b // per_row if rows is None else rows
    out = PackedBatch(
        tokens=np.zeros((rows, length), np.int32),
        segment_ids=np.zeros((rows, length), np.int32),
        positions=np.zeros((rows, length), np.int32),
        response=np.zeros((rows, length), bool),
        old_logprobs=np.zeros((rows, length), np.float32),
        advantages=np.zeros((rows, length), np.float32),
        sequence=np.full((rows, length), -1, np.int32),
    )
    for i, (r, start, doc) in enumerate(where):
        n_p, n_r = int(prompt_lengths[i]), int(response_lengths[i])
        n = n_p + n_r
        padded = -(-n // align) * align
        at = slice(start, start + padded)
        resp = slice(start + n_p, start + n)
        out.tokens[r, start : start + n] = np.concatenate([prompts[i, :n_p], responses[i, :n_r]])
        out.segment_ids[r, at] = doc + 1
        out.positions[r, at] = np.arange(padded)
        out.response[r, resp] = True
        out.old_logprobs[r, resp] = logprobs[i, :n_r]
        out.advantages[r, at] = advantages[i]
        out.sequence[r, at] = i
    return out
