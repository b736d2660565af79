"""The draft's token tree below the root: a chain, a static tree, EAGLE-2's dynamic tree or its
sampled form, each level one `tree_step` of the draft (an EAGLE-3 head or an MTP module), or of a
block draft's head over the block it computed in one forward (`propose_block`), drawn as
`jspec.sampler.tree` builds it so that `verify` gets the very distributions its nodes came from.
`draft_tree` is any draft's proposal."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jspec.config import RolloutConfig, TreeConfig
from jspec.models.block import BlockDraft
from jspec.models.cache import KVCache, TreeKV
from jspec.models.draft import Draft, DraftOut, Shared
from jspec.sampler.tree import (
    StaticTree,
    Tree,
    build_dynamic_tree,
    build_sampled_dynamic_tree,
    build_static_tree,
)


class _TreeCarry(NamedTuple):
    hidden: Float[Array, "b m h"]  # the draft's hidden state at the previous frontier
    tree: TreeKV  # K/V of the nodes expanded so far
    offset: Int[Array, ""]  # where the next frontier's nodes go in `tree`
    previous: Int[Array, ""]  # where the previous frontier's nodes are


def _static_shape(tree: TreeConfig) -> StaticTree:
    """The topology the draft fills (of a 'dynamic' tree: the sampled form's candidates)."""
    if tree.kind == "dynamic":
        return StaticTree.chain_with_siblings(tree.depth, tree.top_k - 1)
    return StaticTree.chain(tree.depth) if tree.kind == "chain" else StaticTree(tree.parents)


def tree_depth(tree: TreeConfig, draft) -> int:
    """Levels of the draft's tree below the root; 0 without a draft (plain decoding)."""
    return 0 if draft is None else tree.levels


def _tree_capacity(tree: TreeConfig, sampled: bool) -> int:
    """Nodes that get expanded (have children drawn below them), over all levels below the root."""
    if tree.kind == "dynamic" and not sampled:
        return (tree.depth - 1) * tree.top_k
    shape = _static_shape(tree)
    return sum(shape.expanded_at(d).size for d in range(1, int(shape.depth.max())))


def draft_tree(
    draft: Draft | BlockDraft | None,
    shared: Shared,
    state: DraftOut,
    root: Int[Array, " b"],
    key,
    config: RolloutConfig,
) -> Tree:
    """The tree a verify step checks below each row's `root` token: none without a draft (plain
    decoding), a block draft's chain from one forward over its context (`state.cache`), another
    draft's tree grown a level at a time from its `state` at the root (`propose`)."""
    if draft is None:
        empty = jnp.zeros((root.shape[0], 0), jnp.int32)
        return Tree(empty, empty, empty)
    if isinstance(draft, BlockDraft):
        return propose_block(draft, shared, root, state.cache, key, config)
    return propose(draft, shared, state, key, config)


def propose(draft: Draft, shared: Shared, root: DraftOut, key, config: RolloutConfig) -> Tree:
    """The draft's tree below the root, as `config.tree` describes it."""
    tc, sampled = config.tree, config.tree.sampled_at(config.temperature)
    b, frontier = root.logits.shape[0], _first_frontier(config)
    carry = _TreeCarry(
        hidden=jnp.broadcast_to(root.hidden[:, None], (b, frontier, root.hidden.shape[-1])),
        tree=draft.empty_tree(b, max(_tree_capacity(tc, sampled), 1)),
        offset=jnp.int32(0),
        previous=jnp.int32(0),
    )

    def step(frontier, carry: _TreeCarry):
        slot = jnp.maximum(frontier.parent_slot, 0)[..., None]
        parent_hidden = jnp.take_along_axis(carry.hidden, slot, axis=1)
        parent = jnp.where(frontier.parent_slot >= 0, carry.previous + frontier.parent_slot, -1)
        logits, hidden, k, v, anchor = draft.tree_step(
            shared,
            frontier.tokens,
            parent_hidden,
            frontier.depth,
            parent,
            root.cache,
            carry.tree,
            kernels=config.kernels,
        )
        tree = carry.tree.add(k, v, anchor, parent, carry.offset)
        offset = carry.offset + frontier.tokens.shape[1]
        return logits, _TreeCarry(hidden, tree, offset, carry.offset)

    return grow_tree(config, root.logits, step, carry, key)


def _first_frontier(config: RolloutConfig) -> int:
    """Nodes of the tree's first level that get expanded together: EAGLE-2's top_k, else 1."""
    tc = config.tree
    return tc.top_k if tc.kind == "dynamic" and not tc.sampled_at(config.temperature) else 1


def grow_tree(config: RolloutConfig, root_logits, step, carry, key) -> Tree:
    """The tree `config.tree` describes, grown from the draft's `root_logits` by `step` (as
    `jspec.sampler.tree`'s builders call it); `key` draws a sampled tree's nodes."""
    tc, sampled = config.tree, config.tree.sampled_at(config.temperature)
    sampling = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    if tc.kind != "dynamic":
        shape, key = _static_shape(tc), key if sampled else None
        return build_static_tree(shape, root_logits, step, carry, key=key, **sampling)[0]
    if not sampled:
        return build_dynamic_tree(
            root_logits, step, carry, top_k=tc.top_k, depth=tc.depth, total_tokens=tc.total_tokens
        )[0]
    return build_sampled_dynamic_tree(
        root_logits,
        step,
        carry,
        key=key,
        depth=tc.depth,
        children=tc.top_k,
        total_tokens=tc.total_tokens,
        **sampling,
    )[0]


def propose_block(
    draft: BlockDraft,
    shared: Shared,
    root: Int[Array, " b"],
    cache: KVCache,
    key,
    config: RolloutConfig,
) -> Tree:
    """A block draft's tree below each row's root (its `cache` holds the context before it): the
    block's layers run once; a node at depth d is drawn from the head at block position d, which
    the chained head feeds the node's parent (`BlockDraft.chain`); without it every node of a
    depth has the same distribution, computed for all depths at once."""
    h_BKD = draft.block_hidden(shared, root, cache, kernels=config.kernels)
    if not draft.config.chained:
        logits = draft.draft_logits(h_BKD[:, 1:], shared)
        v = logits.shape[-1]
        at = lambda tokens, depth: jnp.broadcast_to(logits[:, depth][:, None], (*tokens.shape, v))
        step = lambda frontier, carry: (at(frontier.tokens, frontier.depth), carry)
        return grow_tree(config, logits[:, 0], step, None, key)

    def step(frontier, z_BMD):
        slot = jnp.maximum(frontier.parent_slot, 0)[..., None]
        z_prev = jnp.take_along_axis(z_BMD, slot, axis=1)
        z = draft.chain(shared, h_BKD[:, frontier.depth + 1][:, None], z_prev, frontier.tokens)
        return draft.draft_logits(z, shared), z

    z_BD = draft.chain(shared, h_BKD[:, 1], h_BKD[:, 0], root)
    z_BMD = jnp.broadcast_to(z_BD[:, None], (z_BD.shape[0], _first_frontier(config), z_BD.shape[1]))
    return grow_tree(config, draft.draft_logits(z_BD[:, None], shared)[:, 0], step, z_BMD, key)
