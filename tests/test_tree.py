"""Draft trees: static topologies, EAGLE-2 dynamic trees against brute force, the branch layout.

The synthetic draft gives every node logits that are a fixed random function of the node's whole
path (a table indexed by row and prefix), so a tree built through `step_fn` can be recomputed
here from first principles.
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampler import (
    StaticTree,
    Tree,
    branch_layout,
    build_dynamic_tree,
    build_sampled_dynamic_tree,
    build_static_tree,
    dynamic_tree_finish,
    dynamic_tree_init,
    dynamic_tree_step,
    sampling_probs,
)

V = 5


def prefix_index(path) -> int:
    """Row of a path's logits in the table: all prefixes, shortest first, base V within a length."""
    start = (V ** len(path) - 1) // (V - 1)
    return start + int(np.ravel_multi_index(path, (V,) * len(path))) if path else 0


def draft_table(batch: int, depth: int, seed: int) -> jax.Array:
    """Logits for every prefix of length < depth, different in every row."""
    shape = (batch, (V**depth - 1) // (V - 1), V)
    return jnp.asarray(2.0 * np.random.default_rng(seed).standard_normal(shape, np.float32))


def draft_step(table, frontier, codes):
    """The synthetic draft as a step_fn: looks up the logits of each frontier node's path;
    `codes` carries the previous frontier's paths in base V."""
    slot = jnp.maximum(frontier.parent_slot, 0)
    parent_codes = jnp.where(frontier.parent_slot >= 0, jnp.take_along_axis(codes, slot, 1), 0)
    codes = parent_codes * V + frontier.tokens
    start = (V**frontier.depth - 1) // (V - 1)
    return jnp.take_along_axis(table, (start + codes)[:, :, None], axis=1), codes


def paths(tree: Tree, row: int) -> list[tuple[int, ...]]:
    """The token path from the root to every node of one row, checking the tree's invariants."""
    tokens, parents, depth = (np.asarray(x)[row] for x in tree[:3])
    out = []
    for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        assert -1 <= parent < i
        out.append((out[parent] if parent >= 0 else ()) + (int(token),))  # -1: a padding node
        assert depth[i] == len(out[-1])
    return out


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def brute_force(table_row, top_k: int, depth: int, total_tokens: int) -> set:
    """EAGLE-2 by enumeration over every path of the full vocabulary up to `depth`.

    A path is a candidate iff its last token is among the top-k of its parent's draft and its
    parent is the root or one of the top-k candidates of its own depth by cumulative
    log-probability; the tree is the `total_tokens` candidates of best cumulative log-probability.
    """
    candidates, frontier, score = {}, {()}, {(): 0.0}
    for d in range(1, depth + 1):
        level = {}
        for path in itertools.product(range(V), repeat=d):
            parent = path[:-1]
            if parent not in frontier:
                continue
            logprobs = log_softmax(table_row[prefix_index(parent)])
            if path[-1] in np.argsort(-logprobs)[:top_k]:
                level[path] = score[parent] + logprobs[path[-1]]
        score.update(level)
        candidates.update(level)
        frontier = set(sorted(level, key=level.get, reverse=True)[:top_k])
    return set(sorted(candidates, key=candidates.get, reverse=True)[:total_tokens])


@functools.partial(jax.jit, static_argnames=("top_k", "depth", "total_tokens"))
def dynamic(table, *, top_k, depth, total_tokens):
    codes = jnp.zeros((table.shape[0], top_k), jnp.int32)  # a scan carry: one shape at every depth
    tree, _ = build_dynamic_tree(
        table[:, 0],
        functools.partial(draft_step, table),
        codes,
        top_k=top_k,
        depth=depth,
        total_tokens=total_tokens,
    )
    return tree


@pytest.mark.parametrize(
    "top_k, depth, total_tokens",
    [(2, 4, 9), (3, 4, 12), (3, 3, 21), (3, 4, 1), (1, 4, 4), (4, 2, 10), (5, 1, 3)],
)
def test_dynamic_tree_equals_brute_force(top_k, depth, total_tokens):
    table = draft_table(batch=6, depth=depth, seed=top_k * 10 + depth)
    tree = dynamic(table, top_k=top_k, depth=depth, total_tokens=total_tokens)
    assert tree.tokens.shape == (6, total_tokens) and tree.point_mass
    for row in range(6):
        built = paths(tree, row)
        assert len(set(built)) == total_tokens
        assert set(built) == brute_force(np.asarray(table[row]), top_k, depth, total_tokens)


def test_dynamic_tree_keeps_ancestors_when_scores_tie():
    """A certain draft token (log-probability 0 in float32) ties a child with its parent; the
    parent must still be kept, so every node's path is complete."""
    table = draft_table(batch=4, depth=4, seed=9).at[:, :, 2].set(200.0)
    tree = dynamic(table, top_k=2, depth=4, total_tokens=3)  # 4 nodes tie at score 0
    for row in range(4):
        assert paths(tree, row) == [(2,), (2, 2), (2, 2, 2)]


def test_dynamic_tree_caller_driven_loop_matches_builder():
    """init / step / finish are the builder's pieces: a caller's own loop gives the same tree."""
    table, top_k, depth = draft_table(batch=3, depth=3, seed=1), 3, 3
    state = dynamic_tree_init(table[:, 0], top_k=top_k, depth=depth)
    codes = jnp.zeros((3, 1), jnp.int32)
    step = jax.jit(draft_step)
    for _ in range(depth - 1):
        logits, codes = step(table, state.frontier_view(), codes)
        state = dynamic_tree_step(state, logits)
    by_hand = dynamic_tree_finish(state, total_tokens=10)
    built = dynamic(table, top_k=top_k, depth=depth, total_tokens=10)
    for mine, theirs in zip(by_hand[:3], built[:3], strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_tree_functions_compile_once_per_shape():
    traces = []

    def counting_step(frontier, carry):
        traces.append(frontier.tokens.shape)
        return jnp.zeros(frontier.tokens.shape + (V,)).at[..., 1].set(frontier.depth), carry

    build = jax.jit(
        lambda root: build_dynamic_tree(
            root, counting_step, None, top_k=2, depth=5, total_tokens=7
        )[0]
    )
    shape = StaticTree((-1, -1, 0, 1, 3))
    build_static = jax.jit(lambda root: build_static_tree(shape, root, counting_step, None)[0])
    layout = jax.jit(branch_layout)
    before = {
        f: f._cache_size() for f in (dynamic_tree_init, dynamic_tree_step, dynamic_tree_finish)
    }
    for seed in range(3):
        root = np.random.default_rng(seed).standard_normal((4, V), np.float32)
        build(root)
        tree = build_static(root)
        layout(tree, tree.tokens[:, 0], jnp.full((4,), seed))
        state = dynamic_tree_init(root, top_k=2, depth=3)
        state = dynamic_tree_step(state, np.broadcast_to(root[:, None], (4, 2, V)) + seed)
        dynamic_tree_finish(state, total_tokens=4)
    assert build._cache_size() == build_static._cache_size() == layout._cache_size() == 1
    assert len(traces) == 1 + 2  # one scan body, and one per expanded depth of the static tree
    for f, size in before.items():  # at most one new entry: the shape may have been seen before
        assert f._cache_size() - size <= 1, f


def test_static_tree_topology():
    shape = StaticTree((-1, 0, -1, 1, 0, 2))
    np.testing.assert_array_equal(shape.depth, [1, 2, 1, 3, 2, 2])
    np.testing.assert_array_equal(shape.rank, [0, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(shape.expanded_at(1), [0, 2])
    np.testing.assert_array_equal(shape.expanded_at(2), [1])
    assert StaticTree.chain(3) == StaticTree([-1, 0, 1]) and hash(StaticTree.chain(3))


def test_static_point_mass_tree_takes_ranked_draft_tokens():
    shape = StaticTree((-1, -1, -1, 0, 0, 2, 3, 3))
    table = draft_table(batch=4, depth=4, seed=3)
    tree, _ = build_static_tree(
        shape, table[:, 0], functools.partial(draft_step, table), jnp.zeros((4, 1), jnp.int32)
    )
    assert tree.point_mass
    for row in range(4):
        for i, path in enumerate(paths(tree, row)):
            parent_logits = np.asarray(table[row, prefix_index(path[:-1])])
            assert path[-1] == np.argsort(-parent_logits, kind="stable")[shape.rank[i]]


def test_static_sampled_tree_records_the_distributions_it_drew_from():
    shape = StaticTree((-1, -1, 0, 0, 0, 2))
    table = draft_table(batch=64, depth=3, seed=4)
    kwargs = dict(temperature=0.7, top_p=0.8)
    build = jax.jit(
        lambda table, key: build_static_tree(
            shape,
            table[:, 0],
            functools.partial(draft_step, table),
            jnp.zeros((64, 1), jnp.int32),
            key=key,
            **kwargs,
        )[0]
    )
    tree = build(table, jax.random.key(0))
    assert not tree.point_mass and tree.draft_probs.shape == (64, shape.num_nodes + 1, V)
    probs = np.asarray(tree.draft_probs)
    table_probs = np.asarray(sampling_probs(table, **kwargs))
    for row in range(64):
        node_paths = paths(tree, row)
        for index, path in [(0, ())] + [(i + 1, p) for i, p in enumerate(node_paths)]:
            if index - 1 in shape.parents:  # the root or a node with children
                want = table_probs[row, prefix_index(path)]
                np.testing.assert_allclose(probs[row, index], want, atol=1e-6)
            else:
                assert not probs[row, index].any()
        drew_from_parents(probs[row], np.asarray(tree.parents)[row], node_paths)


def drew_from_parents(probs, parents, node_paths):
    """Every child was drawn from its parent's draft, without replacement: siblings distinct, a
    padding node only where its parent's draft has no token left for it."""
    for i, path in enumerate(node_paths):
        q = probs[parents[i] + 1]
        siblings = [p[-1] for j, p in enumerate(node_paths[:i]) if parents[j] == parents[i]]
        if path[-1] < 0:
            assert np.count_nonzero(q) <= len(siblings)
        else:
            assert q[path[-1]] > 0 and path[-1] not in siblings


def sampled_dynamic(table, key, **kwargs):
    b = table.shape[0]
    codes = jnp.zeros((b, 1), jnp.int32)
    step = functools.partial(draft_step, table)
    return build_sampled_dynamic_tree(table[:, 0], step, codes, key=key, **kwargs)[0]


def test_sampled_dynamic_tree_is_a_sampled_chain_with_siblings_beside_it():
    """A chain of `depth`, then `total_tokens - depth` siblings of its nodes (leaves, at most
    children - 1 a node), level by level; each node's children drawn from its draft without
    replacement; the distributions at the root and the chain's nodes recorded, none elsewhere."""
    depth, children, total, kwargs = 3, 3, 6, dict(temperature=0.8, top_p=0.9)
    table = draft_table(batch=64, depth=depth, seed=6)
    build = jax.jit(
        functools.partial(
            sampled_dynamic, depth=depth, children=children, total_tokens=total, **kwargs
        )
    )
    tree = build(table, jax.random.key(1))
    parents, probs = np.asarray(tree.parents), np.asarray(tree.draft_probs)
    table_probs = np.asarray(sampling_probs(table, **kwargs))
    assert tree.tokens.shape == (64, total) and probs.shape == (64, total + 1, V)
    for row in range(64):
        node_paths = paths(tree, row)
        assert list(parents[row, :depth]) == list(range(-1, depth - 1))
        leaves = parents[row, depth:]
        assert (np.diff(leaves) >= 0).all() and (leaves < depth - 1).all()
        assert np.bincount(leaves + 1).max() <= children - 1
        for index in range(depth):  # the root, then the chain's nodes with children
            want = table_probs[row, prefix_index(node_paths[index - 1] if index else ())]
            np.testing.assert_allclose(probs[row, index], want, atol=1e-6)
        assert not probs[row, depth:].any()
        drew_from_parents(probs[row], parents[row], node_paths)


def test_sampled_dynamic_tree_puts_its_siblings_where_the_draft_is_least_sure():
    """A flat draft at the root and a sure one below: every sibling is a child of the root; the
    other way round, none is."""
    table = np.zeros((8, 1 + V, V), np.float32)  # the root's logits, then each child's
    table[:, 1:, 0] = 20.0  # below the root the draft is sure
    build = functools.partial(sampled_dynamic, depth=2, children=3, total_tokens=4)
    tree = build(jnp.asarray(table), jax.random.key(2))
    assert (np.asarray(tree.parents)[:, 2:] == -1).all()
    table[:, 0, 1], table[:, 1:] = 20.0, 0.0  # now the root is sure and its children are flat
    tree = build(jnp.asarray(table), jax.random.key(2))
    assert (np.asarray(tree.parents)[:, 2:] == 0).all()


@pytest.mark.parametrize("total_tokens", [1, 7])
def test_sampled_dynamic_tree_of_a_size_it_cannot_hold_is_refused(total_tokens):
    table = draft_table(batch=2, depth=2, seed=0)
    with pytest.raises(ValueError, match=f"holds 2 to 6 nodes; total_tokens={total_tokens}"):
        sampled_dynamic(table, jax.random.key(0), depth=2, children=3, total_tokens=total_tokens)


def test_branch_layout():
    tree = Tree(
        tokens=jnp.array([[7, 3, -1, 4]]),
        parents=jnp.array([[-1, 0, 0, 1]]),
        depth=jnp.array([[1, 2, 2, 3]]),
    )
    layout = branch_layout(tree, root_token=jnp.array([9]), anchor=jnp.array([41]))
    np.testing.assert_array_equal(layout.tokens, [[9, 7, 3, 0, 4]])
    np.testing.assert_array_equal(layout.anchor, [[41, 41, 41, -1, 41]])
    np.testing.assert_array_equal(layout.parent, [[-1, 0, 1, 1, 2]])
    np.testing.assert_array_equal(layout.depth, [[0, 1, 2, 2, 3]])


@pytest.mark.parametrize(
    "parents, message",
    [
        ((0,), "parents[0]=0 must point to an earlier node (-1 <= parent < 0)"),
        ((-1, 2, 0), "parents[1]=2 must point to an earlier node"),
        ((-1, -3), "parents[1]=-3 must point"),
        ((), "needs at least one node"),
    ],
)
def test_static_tree_rejects_bad_parents(parents, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StaticTree(parents)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=6, depth=2, total_tokens=3), "top_k=6 must be in [1, vocab=5]"),
        (dict(top_k=2, depth=0, total_tokens=3), "depth=0 must be >= 1"),
        (dict(top_k=2, depth=3, total_tokens=11), "total_tokens=11 must be in [1, 10]"),
        (dict(top_k=2, depth=3, total_tokens=0), "total_tokens=0 must be in [1, 10]"),
    ],
)
def test_dynamic_tree_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_dynamic_tree(jnp.zeros((2, V)), None, None, **kwargs)


def test_step_fn_with_wrong_logits_is_a_clear_error():
    with pytest.raises(ValueError, match=re.escape("step_fn returned logits (2, 1, 5)")):
        build_static_tree(
            StaticTree((-1, -1, 0, 1)),
            jnp.zeros((2, V)),
            lambda frontier, carry: (jnp.zeros((2, 1, V)), carry),
            None,
        )
    state = dynamic_tree_init(jnp.zeros((2, V)), top_k=2, depth=2)
    with pytest.raises(
        ValueError, match=re.escape("logits (2, 3, 5) must be [batch=2, frontier=2")
    ):
        dynamic_tree_step(state, jnp.zeros((2, 3, V)))
