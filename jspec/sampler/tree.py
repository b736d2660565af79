"""Draft trees with static sizes: chains, static trees given as parent arrays, dynamic EAGLE-2
style trees, and sampled dynamic trees, built level by level from the draft's logits.

A `Tree` holds N nodes per row in topological order (a parent precedes its children; parent -1 is
the root, the last sampled token). Its `draft_probs` say how `jspec.sampler.verify` must treat
it: None marks deterministic proposals (top-k, pruned or reranked trees: the EAGLE-2 tree),
verified as point masses; otherwise they are the distributions every node's children were drawn
from, without replacement in index order (`verify(..., without_replacement=True)`).

A sampled tree may not choose its nodes by their own drawn tokens (the EAGLE-2 reranking does),
or verification would no longer preserve the target's law. What it may do is decide how many
children a node gets from anything drawn before them: `build_sampled_dynamic_tree` draws a chain
and spends a budget of extra siblings where the draft was least sure, judged by the draft's
distributions along the chain, never by the siblings' tokens.

The draft model drives the expansion through a `step_fn(frontier, carry) -> (logits, carry)`: the
frontier is the set of nodes of one depth whose children are drawn next, and `logits [B, m, V]`
are the draft's logits (or log-probabilities) at those nodes. The builders stay jittable, and
every size (nodes, depth, top-k, budget) is static.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jspec.sampler.acceptance import Verdict, check_parents, verify
from jspec.sampler.sampling import check_sampling_args, sample_without_replacement, sampling_probs


class Tree(NamedTuple):
    """A batch of draft trees.

    tokens: node tokens; a negative token marks a padding node.
    parents: the parent's node index, -1 for a child of the root.
    depth: 1 for a child of the root, d + 1 below a node of depth d.
    draft_probs: None for point-mass verification, else the draft's distribution (full
      vocabulary, sampling transform applied) at the root (index 0) and at node i (index i + 1),
      from which each node's children were drawn without replacement, in index order.
    topology: the `StaticTree` every row's parents are, when known while tracing (a static tree's
      builder sets it): `verify` then sees the parents as values (a chain's walk takes no loop).
    """

    tokens: Int[Array, "b n"]
    parents: Int[Array, "b n"]
    depth: Int[Array, "b n"]
    draft_probs: Float[Array, "b n1 v"] | None = None
    topology: "StaticTree | None" = None

    @property
    def point_mass(self) -> bool:
        return self.draft_probs is None

    @property
    def known_parents(self) -> Int[Array, "b n"] | np.ndarray:
        """The parents, as NumPy values where the topology is static (`verify` reads them)."""
        if self.topology is None:
            return self.parents
        return np.broadcast_to(np.asarray(self.topology.parents, np.int32), self.parents.shape)

    def verify(self, key: jax.Array, target_logits: Float[Array, "b n1 v"], **sampling) -> Verdict:
        """`jspec.sampler.verify` of this tree by the rule of how its builder drew it (siblings
        without replacement); `sampling`: temperature, top_p, top_k."""
        return verify(
            key,
            self.tokens,
            self.known_parents,
            target_logits,
            self.draft_probs,
            without_replacement=True,
            **sampling,
        )


class Frontier(NamedTuple):
    """The nodes whose children are drawn next, as the draft model needs them for its forward.

    tokens: the nodes' tokens.
    parent_slot: each node's parent, as its index in the previous frontier (-1 at depth 1: the
      parent is the root), so the draft can find the parent's hidden state and attention row.
    depth: the nodes' depth (the same for all of them): position = root position + depth.
    """

    tokens: Int[Array, "b m"]
    parent_slot: Int[Array, "b m"]
    depth: Int[Array, ""]


StepFn = Callable[[Frontier, Any], tuple[Float[Array, "b m v"], Any]]


class BranchLayout(NamedTuple):
    """The verification forward's branch, in the form of `jspec.attention.Branch`.

    Branch node 0 is the root (the last sampled token, not yet in the cache) and branch node i + 1
    is tree node i. tokens: the model's input ids (padding nodes carry 0). anchor: the index of the
    last cached token for every node, -1 for padding nodes. parent: the branch index of the parent
    (tree parent + 1), -1 for the root. depth: 0 at the root, so positions = root position + depth.
    The target's logits at branch node j are `verify`'s `target_logits[:, j]`.
    """

    tokens: Int[Array, "b n1"]
    anchor: Int[Array, "b n1"]
    parent: Int[Array, "b n1"]
    depth: Int[Array, "b n1"]


def branch_layout(
    tree: Tree, root_token: Int[Array, " b"], anchor: Int[Array, " b"]
) -> BranchLayout:
    """The branch that verifies `tree` in one forward: the root, then the nodes, all anchored at
    the last cached token `anchor`."""
    b = tree.tokens.shape[0]
    real = tree.tokens >= 0
    column = lambda x: jnp.asarray(x, jnp.int32).reshape(b, 1)
    return BranchLayout(
        tokens=jnp.concatenate([column(root_token), jnp.where(real, tree.tokens, 0)], axis=1),
        anchor=jnp.concatenate([column(anchor), jnp.where(real, column(anchor), -1)], axis=1),
        parent=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), tree.parents + 1], axis=1),
        depth=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depth], axis=1),
    )


@jax.tree_util.register_static  # a `Tree`'s topology: part of its structure, not a leaf
@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A fixed tree topology: `parents[i]` is node i's parent (-1 for the root), parents first.

    Hashable, so it can be a static argument. Children of a node are its siblings in index order;
    `rank[i]` is node i's position among them (0 for the first child).
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(int(p) for p in np.asarray(self.parents, np.int64).reshape(-1))
        if not parents:
            raise ValueError("a StaticTree needs at least one node; parents=() has none")
        check_parents(np.asarray(parents))
        object.__setattr__(self, "parents", parents)

    @classmethod
    def chain(cls, k: int) -> "StaticTree":
        """k nodes, each the only child of the previous one."""
        if k < 1:
            raise ValueError(f"a chain needs k >= 1 nodes, got k={k}")
        return cls(tuple(range(-1, k - 1)))

    @classmethod
    def chain_with_siblings(cls, depth: int, siblings: int) -> "StaticTree":
        """A chain of `depth` nodes (0 .. depth - 1), then `siblings` leaves beside each of them
        (beside chain node d - 1: depth x siblings more nodes, level by level): every candidate
        node of a sampled dynamic tree."""
        leaves = [d - 2 for d in range(1, depth + 1) for _ in range(siblings)]
        return cls((*cls.chain(depth).parents, *leaves))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> np.ndarray:
        depth = np.zeros(self.num_nodes, np.int32)
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    @functools.cached_property
    def rank(self) -> np.ndarray:
        parents = np.asarray(self.parents)
        return np.array([np.sum(parents[:i] == p) for i, p in enumerate(parents)], np.int32)

    def nodes_at(self, depth: int) -> np.ndarray:
        """Node indices at `depth`; depth 0 is the root, written -1."""
        return np.array([-1]) if depth == 0 else np.flatnonzero(self.depth == depth)

    def expanded_at(self, depth: int) -> np.ndarray:
        """Nodes at `depth` that have children (the frontier the draft runs on)."""
        nodes = self.nodes_at(depth)
        return nodes[np.isin(nodes, self.parents)]


def build_static_tree(
    shape: StaticTree,
    root_logits: Float[Array, "b v"],
    step_fn: StepFn,
    carry: Any,
    *,
    key: jax.Array | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tree, Any]:
    """Fills a static topology with draft tokens, one depth at a time.

    key=None: deterministic proposals; the child of rank r gets the draft's r-th most likely token
      at its parent (distinct siblings), and the tree is marked for point-mass verification.
    key given: a node's children are drawn from the draft's `sampling_probs(logits, temperature,
      top_p, top_k)` at it, one after another without replacement in index order (a child with
      no token left to draw is a padding node, -1); those distributions are returned as
      `draft_probs` for sampled verification (`verify(..., without_replacement=True)`).
    `step_fn` is called once per depth 1 .. max depth - 1, on the nodes of that depth that have
    children; `root_logits` are the draft's logits at the root.
    """
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    tokens, probs, rows, carry = _fill(shape, root_logits, step_fn, carry, key, sampling)
    b, v = root_logits.shape
    draft_probs = None
    if key is not None:
        draft_probs = jnp.zeros((b, shape.num_nodes + 1, v), jnp.float32).at[:, rows].set(probs)
    tree = Tree(
        tokens=tokens,
        parents=jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (b, shape.num_nodes)),
        depth=jnp.broadcast_to(jnp.asarray(shape.depth), (b, shape.num_nodes)),
        draft_probs=draft_probs,
        topology=shape,
    )
    return tree, carry


def _fill(shape: StaticTree, root_logits, step_fn: StepFn, carry, key, sampling: dict):
    """(tokens [B, N], the draft's distributions [B, E, V] at the root and the E - 1 nodes that
    have children (key given; else None), their rows in `draft_probs` (the root 0, node i i + 1),
    carry) of `build_static_tree`."""
    if key is not None:
        check_sampling_args(**sampling)
    b, v = root_logits.shape
    most_children = int(shape.rank.max()) + 1
    if most_children > v:
        raise ValueError(
            f"a node of {shape} has {most_children} children, more than the vocabulary {v}"
        )
    parents = np.asarray(shape.parents)
    tokens = jnp.full((b, shape.num_nodes), -1, jnp.int32)
    probs, rows = [], []
    frontier, logits = shape.expanded_at(0), root_logits[:, None]
    for depth in range(1, int(shape.depth.max()) + 1):
        if logits.shape != (b, frontier.size, v):
            raise ValueError(
                f"step_fn returned logits {logits.shape} at depth {depth - 1}; expected "
                f"{(b, frontier.size, v)}: one row per frontier node"
            )
        children = shape.nodes_at(depth)
        slot = np.searchsorted(frontier, parents[children])
        if key is None:
            ranked = jax.lax.top_k(logits, most_children)[1].astype(jnp.int32)
        else:
            q = sampling_probs(logits, **sampling)
            probs.append(q)
            rows.append(frontier + 1)
            ranked = sample_without_replacement(jax.random.fold_in(key, depth), q, most_children)
        tokens = tokens.at[:, children].set(ranked[:, slot, shape.rank[children]])
        next_frontier = shape.expanded_at(depth)
        if next_frontier.size:
            parent_slot = np.searchsorted(frontier, parents[next_frontier]) if depth > 1 else -1
            view = Frontier(  # a padding node's children are never tested: any token will do
                tokens=jnp.maximum(tokens[:, next_frontier], 0),
                parent_slot=jnp.broadcast_to(
                    jnp.asarray(parent_slot, jnp.int32), (b, next_frontier.size)
                ),
                depth=jnp.int32(depth),
            )
            logits, carry = step_fn(view, carry)
            frontier = next_frontier
    if key is None:
        return tokens, None, None, carry
    return tokens, jnp.concatenate(probs, axis=1), np.concatenate(rows), carry


def build_sampled_dynamic_tree(
    root_logits: Float[Array, "b v"],
    step_fn: StepFn,
    carry: Any,
    *,
    key: jax.Array,
    depth: int,
    children: int,
    total_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tree, Any]:
    """A sampled chain of `depth` nodes (0 .. depth - 1) and `total_tokens - depth` siblings
    beside its nodes (at most `children - 1` beside each, as leaves), where the draft was least
    sure: a dynamic tree at the draft's cost of a chain, verified with
    `verify(..., without_replacement=True)`.

    Every candidate (`StaticTree.chain_with_siblings`) is drawn as `build_static_tree` draws: at
    each level the chain's node and its would-be siblings are successive draws without
    replacement. The j-th sibling beside chain node d is worth, to the draft, the chance of
    reaching d's parent (the draft's probabilities of the chain's tokens above, multiplied: the
    path score of EAGLE-2) times the j-th largest probability at that parent once the chain's
    token is left out; the siblings of largest worth are kept, in place of `-1` padding nothing
    else. The worth reads the draft's distributions and the chain's tokens, never a sibling's own
    token, so the siblings kept beside a node are its first draws, still draws without
    replacement after the chain's node: the tree stays lossless.
    """
    siblings, extra = children - 1, total_tokens - depth
    if depth < 1 or not 0 <= extra <= depth * siblings:
        raise ValueError(
            f"a sampled dynamic tree of depth={depth} (>= 1) and children={children} holds "
            f"{depth} to {depth * max(children, 1)} nodes; total_tokens={total_tokens} is not "
            "among them"
        )
    shape = StaticTree.chain_with_siblings(depth, siblings)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    tokens, q, _, carry = _fill(shape, root_logits, step_fn, carry, key, sampling)  # q: [B, D, V]
    b, v = root_logits.shape
    nodes = jnp.broadcast_to(jnp.arange(depth), (b, depth))
    if extra:
        nodes = jnp.concatenate([nodes, _kept_siblings(tokens[:, :depth], q, siblings, extra)], 1)
    take = lambda x: jnp.take_along_axis(jnp.broadcast_to(x, tokens.shape), nodes, axis=1)
    tree = Tree(
        tokens=jnp.take_along_axis(tokens, nodes, axis=1),
        parents=take(jnp.asarray(shape.parents, jnp.int32)),
        depth=take(jnp.asarray(shape.depth)),
        draft_probs=jnp.concatenate([q, jnp.zeros((b, 1 + extra, v), q.dtype)], axis=1),
    )
    return tree, carry


def _kept_siblings(chain, q, siblings: int, extra: int) -> Int[Array, "b e"]:
    """Indices in `StaticTree.chain_with_siblings(depth, siblings)` of the `extra` siblings of
    largest worth (`build_sampled_dynamic_tree`), level by level and first draws first."""
    (b, depth), v = chain.shape, q.shape[-1]
    at_chain = jnp.take_along_axis(q, chain[..., None], axis=-1)[..., 0]  # [B, D]
    reach = jnp.cumprod(jnp.concatenate([jnp.ones((b, 1)), at_chain[:, :-1]], axis=1), axis=1)
    others = jnp.where(jnp.arange(v) == chain[..., None], 0.0, q)
    worth = reach[..., None] * jax.lax.top_k(others, siblings)[0]  # [B, D, siblings]
    level = jax.lax.top_k(worth.reshape(b, -1), extra)[1] // siblings
    count = jnp.sum(level[:, :, None] == jnp.arange(depth), axis=1)  # [B, D]: kept per level
    kept = (jnp.arange(siblings) < count[..., None]).reshape(b, -1)  # each level's first draws
    return depth + jnp.argsort(~kept, axis=1, stable=True)[:, :extra]


class DynamicTreeState(NamedTuple):
    """The candidate pool of an EAGLE-2 expansion, with static size P = k + (depth - 1) * k^2.

    Pool slots [0, k) hold the root's top-k children; each step appends the k^2 children (top-k
    each) of the k frontier nodes. Slots not filled yet hold token -1 and score -inf.

    tokens, parents (pool index, -1 for the root), scores (cumulative draft log-probability of
    the path from the root): the pool. frontier: pool indices of the k nodes expanded next;
    frontier_parent_slot: their parents' positions in the previous frontier (-1 at depth 1);
    level: their depth.
    """

    tokens: Int[Array, "b p"]
    parents: Int[Array, "b p"]
    scores: Float[Array, "b p"]
    frontier: Int[Array, "b k"]
    frontier_parent_slot: Int[Array, "b k"]
    level: Int[Array, ""]

    def frontier_view(self) -> Frontier:
        return Frontier(
            tokens=jnp.take_along_axis(self.tokens, self.frontier, axis=1),
            parent_slot=self.frontier_parent_slot,
            depth=self.level,
        )


def _pool_size(top_k: int, depth: int) -> int:
    return top_k + (depth - 1) * top_k * top_k


def _pool_depth(top_k: int, pool_size: int) -> np.ndarray:
    """The depth of every pool slot: k slots at depth 1, then k^2 per depth."""
    slots = np.arange(pool_size)
    return np.where(slots < top_k, 1, 2 + (slots - top_k) // (top_k * top_k)).astype(np.int32)


def check_dynamic_tree_args(top_k: int, depth: int, total_tokens: int, vocab: int) -> None:
    """Sizes of a dynamic tree that cannot work, rejected before tracing."""
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} must be in [1, vocab={vocab}]")
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1 (the number of levels below the root)")
    pool = _pool_size(top_k, depth)
    if not 1 <= total_tokens <= pool:
        raise ValueError(
            f"total_tokens={total_tokens} must be in [1, {pool}]: top_k={top_k} and depth={depth} "
            f"propose {pool} candidates; lower total_tokens or raise top_k or depth"
        )


@functools.partial(jax.jit, static_argnames=("top_k", "depth"))
def dynamic_tree_init(
    root_logits: Float[Array, "b v"], *, top_k: int, depth: int
) -> DynamicTreeState:
    """Starts an expansion: the root's top-k children are both the first pool slots and the
    first frontier."""
    check_dynamic_tree_args(top_k, depth, 1, root_logits.shape[-1])
    b = root_logits.shape[0]
    pool = _pool_size(top_k, depth)
    scores, tokens = jax.lax.top_k(jax.nn.log_softmax(root_logits.astype(jnp.float32)), top_k)
    return DynamicTreeState(
        tokens=jnp.full((b, pool), -1, jnp.int32).at[:, :top_k].set(tokens.astype(jnp.int32)),
        parents=jnp.full((b, pool), -1, jnp.int32),
        scores=jnp.full((b, pool), -jnp.inf, jnp.float32).at[:, :top_k].set(scores),
        frontier=jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (b, top_k)),
        frontier_parent_slot=jnp.full((b, top_k), -1, jnp.int32),
        level=jnp.int32(1),
    )


@jax.jit
def dynamic_tree_step(state: DynamicTreeState, logits: Float[Array, "b k v"]) -> DynamicTreeState:
    """One EAGLE-2 step: each frontier node proposes its top-k children (all join the pool), and
    the k children with the best cumulative score become the next frontier. Call it depth - 1
    times; `logits` are the draft's at `state.frontier_view()`."""
    b, k = state.frontier.shape
    if logits.shape[:2] != (b, k):
        raise ValueError(f"logits {logits.shape} must be [batch={b}, frontier={k}, vocab]")
    child_scores, child_tokens = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)
    frontier_scores = jnp.take_along_axis(state.scores, state.frontier, axis=1)
    scores = (frontier_scores[:, :, None] + child_scores).reshape(b, k * k)
    offset = k + (state.level - 1) * k * k
    write = lambda pool, new: jax.lax.dynamic_update_slice(
        pool, new.astype(pool.dtype), (0, offset)
    )
    best = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    return DynamicTreeState(
        tokens=write(state.tokens, child_tokens.reshape(b, k * k)),
        parents=write(state.parents, jnp.repeat(state.frontier, k, axis=1)),
        scores=write(state.scores, scores),
        frontier=offset + best,
        frontier_parent_slot=best // k,
        level=state.level + 1,
    )


@functools.partial(jax.jit, static_argnames=("total_tokens",))
def dynamic_tree_finish(state: DynamicTreeState, *, total_tokens: int) -> Tree:
    """Reranks the whole pool and keeps the `total_tokens` best paths, as a point-mass tree.

    A child's score is its parent's plus a log-probability <= 0, and ties go to the lower pool
    index (the parent's), so the kept set contains every kept node's ancestors; sorted by pool
    index it is in topological order.
    """
    b, pool = state.tokens.shape
    k = state.frontier.shape[1]
    if not 1 <= total_tokens <= pool:
        raise ValueError(f"total_tokens={total_tokens} must be in [1, pool size {pool}]")
    kept = jnp.sort(jax.lax.top_k(state.scores, total_tokens)[1], axis=1)
    rows = jnp.arange(b)[:, None]
    new_index = (
        jnp.full((b, pool), -1, jnp.int32)
        .at[rows, kept]
        .set(jnp.arange(total_tokens, dtype=jnp.int32))
    )
    pool_parents = jnp.take_along_axis(state.parents, kept, axis=1)
    parents = jnp.where(
        pool_parents >= 0,
        jnp.take_along_axis(new_index, jnp.maximum(pool_parents, 0), axis=1),
        -1,
    )
    return Tree(
        tokens=jnp.take_along_axis(state.tokens, kept, axis=1),
        parents=parents,
        depth=jnp.asarray(_pool_depth(k, pool), jnp.int32)[kept],
    )


def build_dynamic_tree(
    root_logits: Float[Array, "b v"],
    step_fn: StepFn,
    carry: Any,
    *,
    top_k: int,
    depth: int,
    total_tokens: int,
) -> tuple[Tree, Any]:
    """An EAGLE-2 tree: top-k expansion of the k best frontier nodes per depth, then the
    `total_tokens` best paths by cumulative draft log-probability, marked for point-mass
    verification (it was pruned and reranked).

    `step_fn` runs depth - 1 times inside one `lax.scan`, so the draft's forward is traced once
    and `carry` must keep one shape and dtype at every depth (a fixed-size draft cache does).
    Nodes come out in pool order: by depth, then by frontier position and rank.
    """
    check_dynamic_tree_args(top_k, depth, total_tokens, root_logits.shape[-1])
    state = dynamic_tree_init(root_logits, top_k=top_k, depth=depth)

    def level(state_and_carry, _):
        state, carry = state_and_carry
        logits, carry = step_fn(state.frontier_view(), carry)
        return (dynamic_tree_step(state, logits), carry), None

    if depth > 1:  # a pool of depth 1 has no room for a step, not even a traced one
        (state, carry), _ = jax.lax.scan(level, (state, carry), length=depth - 1)
    return dynamic_tree_finish(state, total_tokens=total_tokens), carry
