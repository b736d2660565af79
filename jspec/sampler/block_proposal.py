"""A block draft's proposal (`jspec.models.block`): the chain of its block's predicted tokens,
from one forward, drawn as `build_static_tree` draws a chain, so `verify` gets the very
distributions each node was drawn from and stays lossless."""

from __future__ import annotations

from jaxtyping import Array, Int

from jspec.config import RolloutConfig
from jspec.models.block import BlockDraft
from jspec.models.cache import KVCache
from jspec.models.draft import Shared
from jspec.sampler.tree import StaticTree, Tree, build_static_tree


def propose_block(
    draft: BlockDraft,
    shared: Shared,
    root: Int[Array, " b"],
    cache: KVCache,
    key,
    config: RolloutConfig,
) -> Tree:
    """The chain of `config.tree.depth` nodes below each row's root (the draft's `cache` holds
    the context before it): node d drawn from the draft's sampling distribution at block position
    d + 1 (those distributions are the tree's `draft_probs`), or its argmax where the tree is not
    sampled (point masses). A position's distribution does not depend on the nodes drawn above
    it, so the chain's draws are independent given the block."""
    logits = draft.block_logits(shared, root, cache, kernels=config.kernels)
    step = lambda frontier, carry: (logits[:, frontier.depth][:, None], carry)
    sampled = config.tree.sampled_at(config.temperature)
    sampling = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    chain = StaticTree.chain(config.tree.depth)
    key = key if sampled else None
    return build_static_tree(chain, logits[:, 0], step, None, key=key, **sampling)[0]
