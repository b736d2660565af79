"""Lossless verification of a draft tree: a pure function over logits (the contract:
docs/sampler.md).

The walk. Nodes are topologically ordered (a parent precedes its children), so one pass over the
node indices visits every candidate in the right order: starting at the root, the node in hand is
tested iff it is a (non-padding) child of the current node; when it is accepted it becomes the
current node, and since its own children come later in index order the same pass continues below
it, while its remaining siblings are skipped because their parent is no longer current. The
siblings of a node are therefore tried in index order, each uses its own uniform. The walk only
moves down, so a tested node's earlier (non-padding) siblings were all tested and rejected.

The rules, one function each:
- point-mass proposals (`draft_probs=None`): accept child x with probability p(x); on rejection
  p(x) <- 0 and renormalise (the next sibling is then tested against the remaining mass). What a
  node would face if tested is known beforehand (p at its parent without its earlier siblings'
  tokens), so every node's test is drawn at once and the walk is a few [B, N, N] steps, with one
  pass over the vocabulary, for the next token (`_walk_point_mass`).
- sampled proposals (a chain is the one-sibling case, Leviathan / Chen): accept with probability
  min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)). Siblings drawn i.i.d. from q keep q
  unchanged (SpecInfer multi-step speculative sampling); siblings drawn without replacement, in
  index order, take x out of q and renormalise (recursive rejection sampling without replacement,
  SpecTr / Jeon et al. 2024: no sibling repeats a rejected token). Each residual depends on the one
  before, so this walk costs N steps of O(V) (`_walk_sampled`). A chain has no siblings: every
  node is tested against the distributions at its parent as they came, so its tests are drawn at
  once and only the first rejection's residual is computed (`_walk_chain`), when the parents are
  known while tracing (`jspec.sampler.tree.build_static_tree` gives them so).
- the next token is drawn from p as it stands at the last accepted node: the target itself (a
  bonus token) if no child there was rejected, the residual otherwise.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jspec.attention.zigzag import concrete
from jspec.sampler.sampling import check_sampling_args, sample_from_probs, sampling_probs

# A residual with less mass than this is numerical noise (p == q in exact arithmetic). The walk
# only reaches such a residual through a rejection whose probability is that same mass, so falling
# back to p there moves the output distribution by less than this, per rejection.
_RESIDUAL_FLOOR = 1e-6


class Verdict(NamedTuple):
    """What `verify` decided, per row.

    path: accepted node indices from the root down, -1 padded.
    num_accepted: the number of accepted nodes (the length of `path` before the padding).
    next_token: the correction (after a rejection) or bonus token at the last accepted node.
    """

    path: Int[Array, "b n"]
    num_accepted: Int[Array, " b"]
    next_token: Int[Array, " b"]


def _target_probs(
    logits: Float[Array, "b n1 v"], temperature: float, top_p: float, top_k: int
) -> Float[Array, "b n1 v"]:
    """The target's sampling distribution at every node: exactly what plain sampling uses."""
    return sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)


def _at(p: Float[Array, "b v"], x: Int[Array, " b"]) -> Float[Array, " b"]:
    return jnp.take_along_axis(p, x[:, None], axis=-1)[:, 0]


def _renormalise(r: Float[Array, "b v"], fallback: Float[Array, "b v"]) -> Float[Array, "b v"]:
    """r / sum(r), or `fallback` where r carries no more than numerical noise."""
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass > _RESIDUAL_FLOOR, r / jnp.where(mass > 0, mass, 1.0), fallback)


def _accept_sampled(u: Float[Array, "*b"], p_x: Float[Array, "*b"], q_x: Float[Array, "*b"]):
    """Whether a token drawn from q is accepted under p, given p(x), q(x) and a uniform u."""
    # u < min(1, p/q) without a division: u < 1 always, and q(x) = 0 only for an inconsistent draft.
    return u * q_x < p_x


def _reject_sampled(
    p: Float[Array, "b v"],
    q: Float[Array, "b v"],
    x: Int[Array, " b"],
    without_replacement: bool,
) -> tuple[Float[Array, "b v"], Float[Array, "b v"]]:
    """New (p, q) after rejecting sibling x: p <- norm(max(p - q, 0)); q is kept when the next
    sibling was drawn from q independently of x, and loses x (renormalised) when it was drawn
    without replacement."""
    residual = _renormalise(jnp.maximum(p - q, 0.0), p)
    if not without_replacement:
        return residual, q
    # The next sibling was drawn from the rest of q however little mass it holds (a sure draft
    # leaves 1e-9 and draws from it all the same): renormalised, with no floor, unlike p's.
    rest = jnp.where(jnp.arange(q.shape[-1]) == x[:, None], 0.0, q)
    mass = jnp.sum(rest, axis=-1, keepdims=True)
    return residual, jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), q)


def _point_mass_acceptance(
    at_parent: Float[Array, "b n"], removed: Float[Array, "b n"], repeated: Bool[Array, "b n"]
) -> Float[Array, "b n"]:
    """A node's chance of acceptance if tested: p(x) at its parent once its earlier siblings'
    tokens (`removed`: their distinct tokens' mass) were zeroed and p renormalised, 0 for a token
    already rejected (`repeated`); p(x) itself where the rest carries no more than numerical noise
    (as `_renormalise` falls back)."""
    rest = 1.0 - removed
    renormalised = jnp.where(repeated, 0.0, at_parent / jnp.where(rest > 0, rest, 1.0))
    return jnp.where(rest > _RESIDUAL_FLOOR, renormalised, at_parent)


def _on_path(first: Bool[Array, "b n"], parents: Int[Array, "b n"]) -> Bool[Array, "b n"]:
    """Nodes that are `first` and whose ancestors all are: by pointer jumping, log2(N) rounds."""
    b, n = first.shape
    root = jnp.full((b, 1), n, jnp.int32)  # index n stands for the root, always on the path
    ok = jnp.concatenate([first, jnp.ones((b, 1), bool)], axis=1)
    up = jnp.concatenate([jnp.where(parents >= 0, parents, n), root], axis=1)
    for _ in range(n.bit_length()):
        ok = ok & jnp.take_along_axis(ok, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    return ok[:, :n]


def _walk_point_mass(
    u: Float[Array, "b n"],
    tokens: Int[Array, "b n"],
    parents: Int[Array, "b n"],
    p_all: Float[Array, "b n1 v"],
) -> tuple[Int[Array, "b n"], Int[Array, " b"], Float[Array, "b v"]]:
    """The walk of point-mass proposals, every node at once: (path, num_accepted, the distribution
    of the next token). A node would be accepted if tested when its uniform falls below
    `_point_mass_acceptance`; it is accepted when it would be, no earlier sibling would be (that
    one is tested first and taken) and the same holds of all its ancestors."""
    b, n = tokens.shape
    valid, x = tokens >= 0, jnp.maximum(tokens, 0)
    at_parent = p_all[jnp.arange(b)[:, None], parents + 1, x]  # p(x_i) at i's parent
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [i, j]: j < i
    sibling = (parents[:, :, None] == parents[:, None, :]) & earlier & valid[:, None, :]
    repeated = jnp.any(sibling & (x[:, :, None] == x[:, None, :]), axis=2)
    removed = jnp.sum(jnp.where(sibling & ~repeated[:, None, :], at_parent[:, None, :], 0.0), 2)
    would = valid & (u < _point_mass_acceptance(at_parent, removed, repeated))
    accepted = _on_path(would & ~jnp.any(sibling & would[:, None, :], axis=2), parents)
    index = jnp.arange(n)
    rank = jnp.cumsum(accepted, axis=1) - 1
    at_rank = accepted[:, None, :] & (rank[:, None, :] == index[:, None])  # [b, rank, node]
    path = jnp.max(jnp.where(at_rank, index, -1), axis=2, initial=-1)
    last = jnp.max(jnp.where(accepted, index, -1), axis=1, initial=-1)  # -1: the root
    p = jnp.take_along_axis(p_all, (last + 1)[:, None, None], axis=1)[:, 0]
    # Every valid child of the last accepted node was tested and rejected.
    rejected = jnp.where(valid & (parents == last[:, None]), x, p.shape[-1])
    zeroed = jnp.zeros(p.shape, bool).at[jnp.arange(b)[:, None], rejected].set(True, mode="drop")
    return path, jnp.sum(accepted, axis=1), _renormalise(jnp.where(zeroed, 0.0, p), p)


def _walk_sampled(
    u: Float[Array, "b n"],
    tokens: Int[Array, "b n"],
    parents: Int[Array, "b n"],
    p_all: Float[Array, "b n1 v"],
    q_all: Float[Array, "b n1 v"],
    without_replacement: bool,
) -> tuple[Int[Array, "b n"], Int[Array, " b"], Float[Array, "b v"]]:
    """The walk of sampled proposals, one node a step: (path, num_accepted, the distribution of
    the next token), for every row at once."""
    b, n = tokens.shape

    def step(i, carry):
        current, p, q, path, num = carry
        x = jnp.maximum(tokens[:, i], 0)
        tested = (parents[:, i] + 1 == current) & (tokens[:, i] >= 0)
        accepted = tested & _accept_sampled(u[:, i], _at(p, x), _at(q, x))
        p_rejected, q_rejected = _reject_sampled(p, q, x, without_replacement)
        rejected = (tested & ~accepted)[:, None]
        p = jnp.where(accepted[:, None], p_all[:, i + 1], jnp.where(rejected, p_rejected, p))
        q = jnp.where(accepted[:, None], q_all[:, i + 1], jnp.where(rejected, q_rejected, q))
        path = jnp.where(accepted[:, None] & (jnp.arange(n) == num[:, None]), i, path)
        return jnp.where(accepted, i + 1, current), p, q, path, num + accepted

    zeros = jnp.zeros((b,), jnp.int32)
    if n == 0:  # no draft nodes: the next token comes from the root
        return jnp.zeros((b, 0), jnp.int32), zeros, p_all[:, 0]
    init = (zeros, p_all[:, 0], q_all[:, 0], jnp.full((b, n), -1, jnp.int32), zeros)
    _, p, _, path, num = jax.lax.fori_loop(0, n, step, init)
    return path, num, p


def _walk_chain(
    u: Float[Array, "b n"],
    tokens: Int[Array, "b n"],
    p_all: Float[Array, "b n1 v"],
    q_all: Float[Array, "b n1 v"],
    without_replacement: bool,
) -> tuple[Int[Array, "b n"], Int[Array, " b"], Float[Array, "b v"]]:
    """`_walk_sampled` of a chain (node i the only child of node i - 1), every node at once: a
    node is accepted when its test passes against the distributions at its parent and so did its
    ancestors'; the next token comes from the target at the last accepted node, or from the
    residual there if its child was tested (not padding) and rejected."""
    b, n = tokens.shape
    x = jnp.maximum(tokens, 0)
    at_parent = lambda probs: jnp.take_along_axis(probs[:, :n], x[..., None], axis=2)[..., 0]
    passed = (tokens >= 0) & _accept_sampled(u, at_parent(p_all), at_parent(q_all))
    num = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)
    path = jnp.where(jnp.arange(n) < num[:, None], jnp.arange(n, dtype=jnp.int32), -1)
    at_last = lambda probs: jnp.take_along_axis(probs, num[:, None, None], axis=1)[:, 0]
    p, q = at_last(p_all), at_last(q_all)
    child = jnp.take_along_axis(tokens, jnp.minimum(num, n - 1)[:, None], axis=1)[:, 0]
    rejected = (num < n) & (child >= 0)
    residual, _ = _reject_sampled(p, q, jnp.maximum(child, 0), without_replacement)
    return path, num, jnp.where(rejected[:, None], residual, p)


def _is_chain(parents) -> bool:
    """Whether parents known while tracing make every row a chain: node i below node i - 1."""
    if not concrete(parents):
        return False
    parents = np.asarray(parents)
    return bool(np.all(parents == np.arange(parents.shape[-1]) - 1))


@functools.partial(
    jax.jit, static_argnames=("temperature", "top_p", "top_k", "without_replacement", "chain")
)
def _verify(
    key,
    tokens,
    parents,
    target_logits,
    draft_probs,
    *,
    temperature,
    top_p,
    top_k,
    without_replacement,
    chain,
):
    walk_key, next_key = jax.random.split(key)
    u = jax.random.uniform(walk_key, tokens.shape)
    p_all = _target_probs(target_logits, temperature, top_p, top_k)
    tokens, parents = tokens.astype(jnp.int32), parents.astype(jnp.int32)
    if draft_probs is None:
        path, num_accepted, p_next = _walk_point_mass(u, tokens, parents, p_all)
    elif chain and tokens.shape[1]:
        q_all = draft_probs.astype(jnp.float32)
        path, num_accepted, p_next = _walk_chain(u, tokens, p_all, q_all, without_replacement)
    else:
        q_all = draft_probs.astype(jnp.float32)
        path, num_accepted, p_next = _walk_sampled(
            u, tokens, parents, p_all, q_all, without_replacement
        )
    return Verdict(path, num_accepted, sample_from_probs(next_key, p_next))


def check_parents(parents) -> None:
    """A parent index must point to an earlier node (-1 is the root): the walk relies on it."""
    parents = np.asarray(parents)
    n = parents.shape[-1]
    bad = (parents < -1) | (parents >= np.arange(n))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"parents{list(where)}={int(parents[where])} must point to an earlier node "
            f"(-1 <= parent < {where[-1]}); order the nodes so that every parent precedes its "
            "children, with -1 for children of the root"
        )


def _check_shapes(tokens, parents, target_logits, draft_probs) -> None:
    if tokens.ndim != 2 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens {tokens.shape} and parents {parents.shape} must both be [batch, nodes]"
        )
    b, n = tokens.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (b, n + 1):
        raise ValueError(
            f"target_logits {target_logits.shape} must be [batch, nodes + 1, vocab] = "
            f"[{b}, {n + 1}, vocab]: index 0 at the root, index i + 1 after node i"
        )
    if draft_probs is not None and draft_probs.shape != target_logits.shape:
        raise ValueError(
            f"draft_probs {draft_probs.shape} must have the shape of target_logits "
            f"{target_logits.shape}: the draft's distribution over the full vocabulary at the root "
            "and after every node"
        )


def verify(
    key: jax.Array,
    tokens: Int[Array, "b n"],
    parents: Int[Array, "b n"],
    target_logits: Float[Array, "b n1 v"],
    draft_probs: Float[Array, "b n1 v"] | None = None,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    without_replacement: bool = False,
) -> Verdict:
    """Verifies a batch of draft trees against the target; the output keeps the target's law.

    tokens, parents: the tree's nodes in topological order; parent -1 is a child of the root, a
      negative token a padding node (never accepted; its place must not depend on drawn values).
    target_logits: raw logits, index 0 at the root and i + 1 after node i. The target distribution
      is `sampling_probs(target_logits, temperature, top_p, top_k)`, the same as plain sampling.
    draft_probs: None when the nodes are deterministic proposals (top-k, pruned, reranked, or
      deduplicated trees), verified as point masses. Otherwise the draft's final distributions
      (temperature and top-p already applied), index 0 at the root and i + 1 at node i, from which
      each node's children were drawn independently with replacement, or, with
      `without_replacement`, one after another in index order without replacement (a node's
      first child drawn from q, the next from q without the first, renormalised, and so on: the
      order of Gumbel-top-k). A chain's nodes are the same either way.
    temperature=0 is greedy: the accepted path follows the target's argmax and `next_token` is the
      argmax at the last accepted node, whatever the proposals were.

    The accepted tokens followed by `next_token` are distributed exactly as tokens drawn one at a
    time from the target's sampling distribution. Arguments are checked here, before compilation:
    shapes always, parent indices and tokens when they are concrete values; the sampling parameters
    are static. `top_k` extends the contract of docs/sampler.md so that verification can match plain
    sampling that uses top-k.
    """
    check_sampling_args(temperature, top_p, top_k)
    _check_shapes(tokens, parents, target_logits, draft_probs)
    if concrete(parents):
        check_parents(parents)
    if concrete(tokens) and tokens.size and int(np.max(tokens)) >= target_logits.shape[-1]:
        raise ValueError(
            f"a token id {int(np.max(tokens))} is not in the vocabulary of size "
            f"{target_logits.shape[-1]}; map draft-vocabulary ids to target ids before verifying"
        )
    return _verify(
        key,
        tokens,
        parents,
        target_logits,
        draft_probs,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        without_replacement=bool(without_replacement),
        chain=draft_probs is not None and _is_chain(parents),  # point masses: one walk
    )


def emitted_tokens(tokens: Int[Array, "b n"], verdict: Verdict) -> Int[Array, "b n1"]:
    """The tokens a verification step emits per row: the accepted ones, then `next_token`, -1
    padded to N + 1; row b emits `verdict.num_accepted[b] + 1` tokens."""
    accepted = jnp.take_along_axis(tokens, jnp.maximum(verdict.path, 0), axis=1)
    accepted = jnp.where(verdict.path >= 0, accepted, -1)
    padded = jnp.concatenate([accepted, jnp.full((tokens.shape[0], 1), -1, accepted.dtype)], 1)
    return padded.at[jnp.arange(tokens.shape[0]), verdict.num_accepted].set(verdict.next_token)
