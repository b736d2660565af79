"""Batched speculative generation in one jitted program, with static shapes.

One verify step, for every row at once:

    draft tree (chain, static, EAGLE-2 dynamic or sampled dynamic) from the draft's root logits
      -> the target's branch forward over root + tree against its KV cache (one forward)
      -> `verify`: accepted path and the next token, lossless
      -> emitted tokens cut at EOS and at max_new_tokens; written out with their log-probabilities
      -> the root and accepted nodes' K/V appended to the target's cache; the draft extended by
         the emitted tokens and the target's taps at the nodes before them.

The last emitted token becomes the next root (sampled, not yet in the cache). Plain decoding is the
same loop with a tree of no nodes, so the two compare on equal terms. The loop runs while any row is
active or any prompt waits (`lax.while_loop`). With fewer rows than prompts (`rows`), a row whose
completion has ended takes the next prompt: a refill prefills `refill_rows` prompts into free rows
(the first ones too), so rows that finish early do not idle until the slowest is done. Once none
waits, `buckets` compact: when the rows still running fit a smaller bucket (on every row shard),
they move, caches and draft state with them, into the loop compiled for that many rows, with the
bucket's tree; a long tail of few rows then decodes at the cost of its own batch size. Every size is
static: caches of prompt length + max_new_tokens slots, trees of a fixed node count. Each generated
token's log-probability is taken under the target's sampling distribution (after temperature,
top-k and top-p: `sampling_probs`, the law `verify` preserves), as the policy loss needs it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention.decode import cache_slots
from jspec.config import RolloutConfig
from jspec.models.cache import KVCache
from jspec.models.draft import Draft, DraftOut, Shared
from jspec.models.transformer import Transformer
from jspec.sampler.acceptance import emitted_tokens
from jspec.sampler.arguments import (
    Continued,
    check_generate_args,
    decode_rows,
    refill_rows,
    row_shards,
)
from jspec.sampler.results import Rollout, RolloutStats
from jspec.sampler.sampling import sample_from_probs, sampling_probs
from jspec.sampler.tree import branch_layout
from jspec.sampler.tree_proposal import draft_tree, tree_depth


class _Rows(NamedTuple):
    """The rows' decoding state: both caches, the draft at the root, and the root (the last token
    emitted, not yet in the cache)."""

    cache: Any
    draft: DraftOut | None
    root: Int[Array, " b"]


class _Loop(NamedTuple):
    rows: _Rows  # [B] rows decoded at once
    prompt: Int[Array, " b"]  # the prompt each row completes (P: none)
    length: Int[Array, " b"]  # tokens the row's completion holds
    budget: Int[Array, " b"]  # tokens the row's completion may hold
    done: Bool[Array, " b"]
    queued: Int[Array, ""]  # prompts given a row so far (the next one to start)
    tokens: Int[Array, "p m"]
    logprobs: Float[Array, "p m"]
    lengths: Int[Array, " p"]
    ended: Bool[Array, " p"]  # the completion ended (its row may have moved on or been cut)
    stats: RolloutStats
    key: jax.Array


def generate(
    target: Transformer,
    draft: Draft | None,
    prompts: Int[Array, "p t"],
    prompt_lengths: Int[Array, " p"],
    key: jax.Array,
    config: RolloutConfig,
    *,
    continued: Continued | None = None,
    keep: int = 0,
    budgets: Int[Array, " p"] | None = None,
) -> Rollout:
    """Completions of right-padded prompts (prompt p: its first `prompt_lengths[p]` tokens).

    `draft` None decodes plainly; otherwise `config.tree` says which tree it proposes.
    `config.rows` rows decode at once, each taking the next prompt when its completion ends.
    `continued` completions go on in the first rows (after the prompts in the outputs); with
    `keep` the rollout returns once no prompt waits and at most `keep` rows still run, those
    unfinished (`Rollout.finished`): a caller continues them later. `budgets` caps each prompt's
    new tokens below `config.max_new_tokens` (a length a completion ends at without an end token).
    Every argument is checked before compilation; the program is compiled once per shape, config
    and `keep`.
    """
    args = (target, draft, prompts, prompt_lengths, key, config, continued, keep, budgets)
    return _generate(*_generate_args(*args), config=config, keep=keep)


def compile_generate(
    target,
    draft,
    prompts,
    prompt_lengths,
    key,
    config: RolloutConfig,
    continued=None,
    keep=0,
    budgets=None,
) -> None:
    """Compiles the program `generate` runs on these arguments' shapes, without running it; a
    later `generate` call reuses it. Compiling takes long on about one core, so several programs
    may compile at once in threads, without the memory that running them at once would take."""
    args = (target, draft, prompts, prompt_lengths, key, config, continued, keep, budgets)
    _generate.lower(*_generate_args(*args), config=config, keep=keep).compile()


def compiled_programs() -> int:
    """Rollout programs compiled so far in this process: one per shape and config (the buckets
    of a rollout are stages of its one program)."""
    return _generate._cache_size()


def _generate_args(
    target, draft, prompts, prompt_lengths, key, config: RolloutConfig, continued, keep, budgets
) -> tuple:
    check_generate_args(target, draft, prompts, prompt_lengths, config, continued, keep, budgets)
    target_def, target_state = nnx.split(target)
    draft_def, draft_state = nnx.split(draft) if draft is not None else (None, None)
    state = (target_state, draft_state)
    return target_def, draft_def, *state, prompts, prompt_lengths, key, continued, budgets


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "config", "keep"))
def _generate(target_def, draft_def, target_state, draft_state, prompts, lengths, key, continued,
              budgets, *, config, keep):  # fmt: skip
    target = nnx.merge(target_def, target_state)
    draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
    args = (target, draft, prompts, lengths, key, config)
    return rollout(*args, continued=continued, keep=keep, budgets=budgets)


def rollout(
    target: Transformer,
    draft: Draft | None,
    prompts: Int[Array, "p t"],
    lengths: Int[Array, " p"],
    key: jax.Array,
    config: RolloutConfig,
    *,
    continued: Continued | None = None,
    keep: int = 0,
    budgets: Int[Array, " p"] | None = None,
) -> Rollout:
    """The traceable body of `generate` (call it inside your own `jit`)."""
    target = target.for_rollout()
    draft = None if draft is None else draft.for_rollout()
    p, t = prompts.shape
    m = config.max_new_tokens
    k = 0 if continued is None else continued.lengths.shape[0]
    b = decode_rows(config, p + k)
    lengths = jnp.asarray(lengths, jnp.int32)
    failed = (lengths < 1) | (lengths > t)
    lengths = jnp.clip(lengths, 1, t)
    budgets = jnp.clip(jnp.full((p,), m) if budgets is None else budgets, 1, m).astype(jnp.int32)
    shared = Shared.of(target)  # in the compute dtype (`for_rollout`)
    start = functools.partial(_start, target, draft, shared, config)
    chunk = refill_rows(config, b, p + k, target.mesh)
    fill = functools.partial(_fill, start, config, prompts, lengths, budgets, chunk)
    shards = row_shards(target.mesh)
    stage_configs = stages(config, b, keep)
    depth = max(tree_depth(c.tree, draft) for _, c in stage_configs)
    zeros, per_stage = jnp.zeros((p + k,), jnp.int32), jnp.zeros((len(stage_configs),), jnp.int32)
    stats = RolloutStats(
        steps=zeros,
        accepted=zeros,
        reached_depth=jnp.zeros((depth,), jnp.int32),
        accepted_non_first=zeros,
        failed=jnp.pad(failed, (0, k)),
        iterations=jnp.int32(0),
        row_steps=per_stage,
        emitted=per_stage,
    )
    state = _Loop(
        rows=_empty_rows(target, draft, start, b, prompts.dtype, t, m),
        prompt=jnp.full((b,), p + k),
        length=jnp.ones((b,), jnp.int32),
        budget=jnp.full((b,), m),
        done=jnp.ones((b,), bool),
        queued=jnp.int32(0),
        tokens=jnp.full((p + k, m), -1, jnp.int32),
        logprobs=jnp.zeros((p + k, m), jnp.float32),
        lengths=jnp.ones((p + k,), jnp.int32),
        ended=jnp.zeros((p + k,), bool),
        stats=stats,
        key=key,
    )
    carried, free = _continued_rows(k, b, shards)
    if continued is not None:
        state = _continue(start, config, continued, p, carried, state)
    # The rows' first prompts, `chunk` rows at a time: a prefill's activations are of that many.
    free = jnp.asarray(np.pad(free, (0, -len(free) % chunk), constant_values=b))
    first = lambda i, s: fill(s, jax.lax.dynamic_slice_in_dim(free, i * chunk, chunk))
    state = jax.lax.fori_loop(0, len(free) // chunk, first, state)
    for i, (rows, stage) in enumerate(stage_configs):
        step = functools.partial(_verify_step, target, draft, shared, stage, i)
        if i:
            state = _compact(state, rows, shards)
        elif b < p + k:
            step = lambda s, step=step: step(_refill(fill, chunk, p, s))
        # On while a prompt waits, or more than `keep` rows run and (a bucket below) they do not
        # fit it. A shard's running rows beyond its share of the next bucket (only ever with
        # `keep` rows or fewer running) are left out of it unfinished, their tokens so far kept.
        below = stage_configs[i + 1][0] if i + 1 < len(stage_configs) else 0
        running = lambda s, below=below: (
            (s.queued < p) | ((jnp.sum(~s.done) > keep) & (_live_per_shard(s, shards) > below))
        )
        state = jax.lax.while_loop(running, step, state)
    return Rollout(state.tokens, state.lengths, state.logprobs, state.ended, state.stats)


def stages(config: RolloutConfig, rows: int, keep: int = 0) -> list[tuple[int, RolloutConfig]]:
    """(rows, config) of the batch of `rows` decoded at once and of each bucket below it, in
    order: the stages of a rollout (`RolloutStats.row_steps` and `emitted` are theirs). A
    rollout that returns with `keep` rows still running never reaches a bucket of as few."""
    below = [b for b in config.buckets if keep < b.rows < rows]
    tree = lambda b: dataclasses.replace(config, tree=b.tree or config.tree)
    return [(rows, config)] + [(b.rows, tree(b)) for b in below]


def _live_per_shard(s: _Loop, shards: int):
    """Rows still running, on the row shard that has most (x shards: what a bucket must hold)."""
    return jnp.max(jnp.sum(~s.done.reshape(shards, -1), axis=1)) * shards


def _compact(s: _Loop, rows: int, shards: int) -> _Loop:
    """`s` in `rows` rows: each row shard's running rows first (all of them: the loop before
    stops only once they fit), its finished ones after, none moved to another shard."""
    first = jnp.argsort(s.done.reshape(shards, -1), axis=1, stable=True)[:, : rows // shards]
    take = lambda x: mesh_lib.take_local_rows(x, first)
    return s._replace(
        rows=jax.tree.map(take, s.rows),
        prompt=take(s.prompt),
        length=take(s.length),
        budget=take(s.budget),
        done=take(s.done),
    )


def _start(target, draft, shared, config: RolloutConfig, prompts, lengths, key):
    """(`_Rows` of prompts, the roots' log-probabilities): both caches prefilled (as long as the
    prompts: `_place` puts them into the rows' longer ones) and the root sampled."""
    b, t = prompts.shape
    features = None if draft is None else draft.features
    slots = cache_slots(t, target.config.max_seq_len)
    cache = target.init_cache(b, slots)
    out = target.prefill(prompts, cache, lengths, features=features, kernels=config.kernels)
    probs = _sampling_probs(out[0], config)
    root = sample_from_probs(key, probs)
    draft_out = None
    if draft is not None:
        features = out[2] if features else None
        draft_cache = draft.init_cache(b, t)
        draft_out = draft.prefill(
            shared, prompts, lengths, root, features, draft_cache, kernels=config.kernels
        )
    return _Rows(out[1], draft_out, root), _log_at(probs, root)


def _empty_rows(target, draft, start, b: int, dtype, t: int, m: int) -> _Rows:
    """`_Rows` of nothing yet for `b` rows of prompts of `t` tokens, shaped as `start` makes them;
    the caches placed as `init_cache` places them (a loop carry takes its sharding from its first
    value)."""
    shapes = jax.ShapeDtypeStruct((b, t), dtype), jax.ShapeDtypeStruct((b,), jnp.int32)
    zeros = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(start, *shapes, jax.random.key(0))[0]
    )
    slots = cache_slots(t + m, target.config.max_seq_len)
    draft_out = None if draft is None else zeros.draft._replace(cache=draft.init_cache(b, t + m))
    return zeros._replace(cache=target.init_cache(b, slots), draft=draft_out)


def _refill(fill, chunk: int, p: int, s: _Loop) -> _Loop:
    """`fill` the first free rows once `chunk` of them are free (or as many of the `p` prompts
    wait): a loop of zero or one trip, which updates the rows in place (a `cond` would copy
    them)."""
    count = jnp.minimum(chunk, p - s.queued)
    ready = (count > 0) & (jnp.sum(s.done) >= count)

    def fill_free(_, s: _Loop) -> _Loop:
        free = jnp.argsort(~s.done, stable=True)[:chunk]  # free rows first
        return fill(s, jnp.where(s.done[free], free, s.done.shape[0]))

    return jax.lax.fori_loop(0, ready.astype(jnp.int32), fill_free, s)


def _fill(
    start, config: RolloutConfig, prompts, lengths, budgets, chunk: int, s: _Loop, rows
) -> _Loop:
    """Starts the next prompts (as many as wait, at most `chunk`) in `rows` ([chunk]; b: none,
    after the rows given), in one prefill of `chunk` rows, each with its budget of new tokens."""
    p, b = prompts.shape[0], s.done.shape[0]
    start_key, key = jax.random.split(s.key)
    taken = (rows < b) & (jnp.arange(chunk) < p - s.queued)
    row = jnp.where(taken, rows, b)
    prompt = jnp.where(taken, s.queued + jnp.arange(chunk), s.tokens.shape[0])
    index = jnp.minimum(prompt, p - 1)
    new, logprob = start(prompts[index], lengths[index], start_key)
    budget = budgets[index]
    s = _place(s, config, row, prompt, new, logprob, budget)
    return s._replace(queued=s.queued + jnp.sum(taken), key=key)


def _continued_rows(k: int, b: int, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `k` continued completions, dealt over the row shards in turn (a shard's live
    rows hold back the buckets: the long ones must not crowd one), and the rows left free."""
    j = np.arange(k)
    carried = (j % shards) * (b // shards) + j // shards
    return carried, np.setdiff1d(np.arange(b), carried)


def _continue(start, config, continued: Continued, p: int, rows: np.ndarray, s: _Loop) -> _Loop:
    """The continued completions (outputs p, p + 1, ...) started in `rows`: their caches filled
    from their tokens so far, in one prefill of their own width."""
    start_key, key = jax.random.split(s.key)
    lengths = jnp.asarray(continued.lengths, jnp.int32)
    new, logprob = start(continued.tokens, lengths, start_key)
    outputs = p + jnp.arange(len(rows))
    budgets = jnp.asarray(continued.budgets, jnp.int32)
    s = _place(s, config, jnp.asarray(rows), outputs, new, logprob, budgets)
    return s._replace(key=key)


def _place(s: _Loop, config: RolloutConfig, row, prompt, new: _Rows, logprob, budget) -> _Loop:
    """`s` with rows `row` (b: none) starting completions `prompt` from `new` (prefilled, its
    root sampled: their first token) with `budget` tokens each."""
    put = lambda old, x: old.at[row].set(x, mode="drop")
    put_rows = lambda old, x: old.put_rows(row, x) if isinstance(old, KVCache) else put(old, x)
    done = _stops(new.root, config) | (budget == 1)
    return s._replace(
        rows=jax.tree.map(put_rows, s.rows, new, is_leaf=lambda x: isinstance(x, KVCache)),
        prompt=put(s.prompt, prompt),
        length=put(s.length, 1),
        budget=put(s.budget, budget),
        done=put(s.done, done),
        ended=s.ended.at[prompt].set(done, mode="drop"),
        tokens=s.tokens.at[prompt, 0].set(new.root, mode="drop"),
        logprobs=s.logprobs.at[prompt, 0].set(logprob, mode="drop"),
    )


def _verify_step(target, draft, shared, config: RolloutConfig, stage: int, s: _Loop) -> _Loop:
    """Draft a tree, verify it in one target forward, emit, and advance both caches (statistics
    of stage `stage`); the parts are named scopes (op_name), which profiles and censuses count."""
    b, m, root = s.done.shape[0], s.tokens.shape[1], s.rows.root
    key, tree_key, verify_key = jax.random.split(s.key, 3)
    with jax.named_scope("draft_tree"):
        tree = draft_tree(draft, shared, s.rows.draft, root, tree_key, config)
    with jax.named_scope("target_forward"):
        logits, features, advance = _target_forward(target, draft, tree, s, config)
    sampling = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    with jax.named_scope("verify"):
        verdict = tree.verify(verify_key, logits, **sampling)
    # An accepted path is no longer than the tree is deep: of N + 1 columns, the first 1 + depth.
    width = 1 + tree_depth(config.tree, draft)
    emitted = emitted_tokens(tree.tokens, verdict)[:, :width]
    # Node (branch index) before each emitted token: the root, then the accepted path.
    source = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), verdict.path[:, : width - 1] + 1], 1)
    source = jnp.maximum(source, 0)
    count = _emit_count(emitted, verdict.num_accepted + 1, s.length, s.budget, s.done, config)

    j = jnp.arange(emitted.shape[1])
    slot = jnp.where(j < count[:, None], s.length[:, None] + j, m)
    rows = s.prompt[:, None]
    probs = jnp.take_along_axis(_sampling_probs(logits, config), source[..., None], axis=1)
    tokens = s.tokens.at[rows, slot].set(emitted, mode="drop")
    logprobs = s.logprobs.at[rows, slot].set(_log_at(probs, jnp.maximum(emitted, 0)), mode="drop")
    length = s.length + count
    last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    emitted_eos = jnp.any(_stops(emitted, config) & (j < count[:, None]), axis=1)

    pick = lambda x: jnp.take_along_axis(x, source.reshape(1, b, -1, *([1] * (x.ndim - 3))), 2)
    with jax.named_scope("cache_advance"):
        cache, draft_out = advance(pick, count), s.rows.draft
    if draft is not None:
        features = None if features is None else pick(features)
        cache_d, kernels = draft_out.cache, config.kernels
        with jax.named_scope("draft_extend"):
            new = draft.extend(shared, emitted, features, count, cache_d, kernels=kernels)
        keep = (count > 0)[:, None]
        draft_out = DraftOut(
            jnp.where(keep, new.logits, draft_out.logits),
            jnp.where(keep, new.hidden, draft_out.hidden),
            new.cache,
        )
    accepted = jnp.maximum(count - 1, 0)
    add = lambda total, x: total.at[s.prompt].add(x, mode="drop")
    d = jnp.arange(1, s.stats.reached_depth.shape[0] + 1)
    stats = RolloutStats(
        steps=add(s.stats.steps, ~s.done),
        accepted=add(s.stats.accepted, accepted),
        reached_depth=s.stats.reached_depth + jnp.sum(accepted[:, None] >= d, axis=0),
        accepted_non_first=add(
            s.stats.accepted_non_first, _non_first_accepted(tree.parents, verdict.path, accepted)
        ),
        failed=s.stats.failed.at[s.prompt].max(cache.overflowed, mode="drop"),
        iterations=s.stats.iterations + 1,
        row_steps=s.stats.row_steps.at[stage].add(b),
        emitted=s.stats.emitted.at[stage].add(jnp.sum(count)),
    )
    done = s.done | emitted_eos | (length >= s.budget)
    return s._replace(
        rows=_Rows(cache, draft_out, jnp.where(count > 0, last, root)),
        length=length,
        done=done,
        ended=s.ended.at[s.prompt].set(done, mode="drop"),
        tokens=tokens,
        logprobs=logprobs,
        lengths=s.lengths.at[s.prompt].set(length, mode="drop"),
        stats=stats,
        key=key,
    )


def _target_forward(target, draft, tree, s: _Loop, config: RolloutConfig):
    """The target's logits at the root and the tree's nodes [B, N+1, V], their features for the
    draft (None without), and `advance(pick, count)`: the cache holding the K/V of each row's
    `count` emitted tokens' sources (the root and the accepted path; `pick` takes them from the
    nodes'). A chain (plain decoding's: the root alone) runs as `Transformer.extend`, each layer
    writing its nodes' K/V into the cache where the decode kernel reads them, and the rejected
    ones are forgotten after; another tree runs as a branch beside the cache, the accepted path
    appended after."""
    cache, root, kernels = s.rows.cache, s.rows.root, config.kernels
    wanted = None if draft is None else draft.features
    if draft is None or config.tree.kind == "chain":
        nodes = jnp.concatenate([root[:, None], tree.tokens], axis=1)
        # Nodes past a row's budget are never emitted: not written, so the cache never overflows.
        written = jnp.where(s.done, 0, jnp.minimum(nodes.shape[1], s.budget - s.length))
        logits, grown, *features = target.extend(
            nodes, cache, written, features=wanted, kernels=kernels
        )
        return (
            logits,
            (features or [None])[0],
            lambda pick, count: grown.forget(cache.length + count),
        )
    layout = branch_layout(tree, root, cache.length - 1)
    positions = cache.length[:, None] + layout.depth
    nodes = (layout.tokens, positions, layout.anchor, layout.parent)
    logits, k, v, *features = target.branch_forward(cache, *nodes, features=wanted, kernels=kernels)
    advance = lambda pick, count: cache.append(pick(k), pick(v), count)
    return logits, (features or [None])[0], advance


def _emit_count(emitted, count, length, budget, done, config: RolloutConfig):
    """Tokens of each row actually emitted: cut after the first EOS and at the row's budget."""
    j = jnp.arange(emitted.shape[1])
    eos = _stops(emitted, config) & (j < count[:, None])
    through_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1) + 1, count)
    count = jnp.minimum(jnp.minimum(count, through_eos), budget - length)
    return jnp.where(done, 0, count)


def _stops(tokens, config: RolloutConfig):
    if config.eos_id is None:
        return jnp.zeros(tokens.shape, bool)
    return tokens == config.eos_id


def _non_first_accepted(parents, path, accepted):
    """Per row, accepted nodes (the first `accepted` of `path`) that have an earlier sibling."""
    n = parents.shape[1]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [i, j]: j < i
    has_earlier_sibling = jnp.any((parents[:, :, None] == parents[:, None, :]) & earlier, axis=2)
    on_path = jnp.take_along_axis(has_earlier_sibling, jnp.maximum(path, 0), axis=1)
    return jnp.sum(on_path & (jnp.arange(n) < accepted[:, None]), axis=1)


def _sampling_probs(logits, config: RolloutConfig):
    return sampling_probs(
        logits, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k
    )


def _log_at(probs, tokens):
    p = jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    return jnp.log(p)
