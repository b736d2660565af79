"""Losslessness of `verify`, tested on its output distribution, and the rules it must not bend.

The statistical tests use a toy language model over V = 4 tokens whose logits are a fixed random
function of the whole prefix (a table indexed by prefix), for the target and for the draft. A tree
is drafted from the draft table, verified against the target table, and the emitted tokens are
continued by plain sampling from the target up to a fixed length L. If verification is lossless,
those L tokens follow the exact joint law of L tokens sampled one by one from the target, which is
computed here in float64; a chi-square test at a fixed seed over 100,000 rows (the batch) must
accept it at p > 1e-3. Every mutation below breaks one rule on the real code path; the same test
must reject it at p < 1e-3 (in practice p is far smaller).
"""

import contextlib
import dataclasses
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square_p_value

import jspec.sampler.acceptance as acceptance
import jspec.sampler.tree as tree_lib
from jspec.sampler import (
    StaticTree,
    build_sampled_dynamic_tree,
    build_static_tree,
    emitted_tokens,
    sampling_probs,
)
from jspec.sampler.acceptance import verify
from jspec.sampler.sampling import _keep, _top_p_mask

V = 4
TRIALS = 100_000
P_VALUE = 1e-3
FAN_OUT = StaticTree((-1, -1, -1, 0, 0, 1, 1, 2, 2))  # three siblings, two children each
INTERLEAVED = StaticTree((-1, 0, -1, 1, 0, 2))  # siblings not contiguous; depth 3


@dataclasses.dataclass(frozen=True)
class SampledDynamic:
    """The arguments of `build_sampled_dynamic_tree` (its nodes' parents differ by row)."""

    depth: int
    children: int
    total_tokens: int


def offsets(length: int) -> np.ndarray:
    """Index of the first prefix of each length, prefixes of one length in base-V order."""
    return np.array([(V**n - 1) // (V - 1) for n in range(length + 1)])


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["target", "draft"], meta_fields=["length"]
)
@dataclasses.dataclass(frozen=True)
class ToyModels:
    """Target and draft logits as tables indexed by prefix, up to prefixes of length L - 1.

    A pytree whose tables are traced arguments: baked in as constants, XLA would spend most of the
    test constant-folding the sampling transform over the batch.
    """

    target: jax.Array
    draft: jax.Array
    length: int

    @classmethod
    def make(cls, length: int, seed: int, draft_sharpness: float = 1.0) -> "ToyModels":
        """`draft_sharpness` scales the draft's logits: at 12 it puts all but about 1e-9 of its
        mass on one token, wherever the target is unsure."""
        rows = offsets(length)[-1]
        rng = np.random.default_rng(seed)
        target = 1.5 * rng.standard_normal((rows, V), np.float32)
        draft = 0.6 * target + 1.2 * rng.standard_normal((rows, V), np.float32)
        return cls(jnp.asarray(target), jnp.asarray(draft_sharpness * draft), length)

    def draft_step(self, frontier, codes):
        """step_fn for the tree builders; `codes` are the frontier's prefixes in base V."""
        slot = jnp.maximum(frontier.parent_slot, 0)
        parent_codes = jnp.where(frontier.parent_slot >= 0, jnp.take_along_axis(codes, slot, 1), 0)
        codes = parent_codes * V + frontier.tokens
        return self.draft[jnp.asarray(offsets(self.length))[frontier.depth] + codes], codes

    def target_logits(self, parents, depth, tokens):
        """[B, N + 1, V]: at the root, then after every node's path (parents, depth: [B, N])."""
        codes = jnp.zeros((tokens.shape[0], 1), jnp.int32)  # column 0: the root
        for i in range(tokens.shape[1]):
            parent_code = jnp.take_along_axis(codes, parents[:, i : i + 1] + 1, axis=1)
            code = parent_code * V + jnp.maximum(tokens[:, i : i + 1], 0)
            codes = jnp.concatenate([codes, code], axis=1)
        first = jnp.asarray(offsets(self.length))[jnp.pad(depth, ((0, 0), (1, 0)))]
        return self.target[first + codes]

    def joint(self, temperature, top_p, top_k=0):
        """Exact probability of every sequence of L tokens sampled one by one from the target."""
        probs = np.asarray(
            sampling_probs(self.target, temperature=temperature, top_p=top_p, top_k=top_k),
            np.float64,
        )
        joint, starts = np.ones(1), offsets(self.length)
        for n in range(self.length):
            joint = (joint[:, None] * probs[starts[n] : starts[n + 1]]).reshape(-1)
        return joint


def continue_from_target(key, models, emitted, temperature, top_p, top_k):
    """Completes each row to L tokens by plain sampling from the target; returns base-V codes."""
    code = jnp.zeros(emitted.shape[0], jnp.int32)
    for n in range(models.length):
        logits = models.target[offsets(models.length)[n] + code]
        fresh = jax.random.categorical(
            jax.random.fold_in(key, n),
            jnp.log(sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)),
        )
        token = jnp.where(emitted[:, n] >= 0, emitted[:, n], fresh)
        code = code * V + token
    return code


def dedup_siblings(shape: StaticTree, tokens):
    """The mutation 'siblings deduplicated': a repeated sibling token becomes a padding node."""
    parents = np.asarray(shape.parents)
    for i in range(shape.num_nodes):
        earlier = np.flatnonzero(parents[:i] == parents[i])
        if earlier.size:
            repeated = (tokens[:, earlier] == tokens[:, i : i + 1]).any(axis=1)
            tokens = tokens.at[:, i].set(jnp.where(repeated, -1, tokens[:, i]))
    return tokens


@functools.partial(
    jax.jit,
    static_argnames=(
        "shape",
        "sampled",
        "temperature",
        "top_p",
        "top_k",
        "padding",
        "mutate_tree",
        "without_replacement",
    ),
)
def emitted_codes(
    key,
    models,
    *,
    shape,
    sampled,
    temperature,
    top_p,
    top_k=0,
    padding=(),
    mutate_tree=None,
    without_replacement=True,
):
    draft_key, verify_key, continue_key = jax.random.split(key, 3)
    root = jnp.broadcast_to(models.draft[0], (TRIALS, V))
    codes = jnp.zeros((TRIALS, 1), jnp.int32)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    if isinstance(shape, SampledDynamic):
        tree, _ = build_sampled_dynamic_tree(
            root, models.draft_step, codes, key=draft_key, **dataclasses.asdict(shape), **sampling
        )
    else:
        key = draft_key if sampled else None
        tree, _ = build_static_tree(shape, root, models.draft_step, codes, key=key, **sampling)
    tokens = tree.tokens.at[:, list(padding)].set(-1)
    if mutate_tree is not None:
        tokens = mutate_tree(shape, tokens)
    verdict = verify(
        verify_key,
        tokens,
        tree.known_parents,  # as `Tree.verify` gives them: a chain's walk takes no loop
        models.target_logits(tree.parents, tree.depth, tokens),
        tree.draft_probs,
        **sampling,
        without_replacement=without_replacement,
    )
    emitted = emitted_tokens(tokens, verdict)
    return continue_from_target(continue_key, models, emitted, temperature, top_p, top_k)


def lossless_p_value(seed=0, replacement=False, draft_sharpness=1.0, **case) -> float:
    """The chi-square p-value of one case; `replacement`: siblings drawn i.i.d. (with replacement)
    and verified so."""
    shape = case["shape"]
    depth = shape.depth if isinstance(shape, SampledDynamic) else int(shape.depth.max())
    models = ToyModels.make(length=depth + 1, seed=seed, draft_sharpness=draft_sharpness)
    with drawn_with_replacement() if replacement else contextlib.nullcontext():
        codes = emitted_codes(
            jax.random.key(seed + 1), models, without_replacement=not replacement, **case
        )
    return chi_square_p_value(
        codes, models.joint(case["temperature"], case["top_p"], case.get("top_k", 0))
    )


def draw_with_replacement(key, probs, k):
    """k independent draws per row from `probs`: the tree builders' siblings, i.i.d."""
    log_probs = jnp.log(jnp.where(probs > 0, probs, 0.0))
    draws = jax.random.categorical(key, log_probs, shape=(k, *probs.shape[:-1]))
    return jnp.moveaxis(draws, 0, -1).astype(jnp.int32)


def drawn_with_replacement():
    """The tree builders draw siblings i.i.d. (their traces with it are apart: verification with
    replacement is its own static argument of `emitted_codes`)."""
    return mock.patch.object(tree_lib, "sample_without_replacement", draw_with_replacement)


CASES = {
    "sampled chain": dict(shape=StaticTree.chain(2), sampled=True, temperature=0.7, top_p=0.9),
    "point-mass chain": dict(shape=StaticTree.chain(2), sampled=False, temperature=1.0, top_p=1.0),
    "sampled tree": dict(shape=FAN_OUT, sampled=True, temperature=0.8, top_p=1.0),
    "point-mass tree": dict(shape=FAN_OUT, sampled=False, temperature=0.6, top_p=0.85),
    "sampled tree with padding and top-k": dict(
        shape=INTERLEAVED, sampled=True, temperature=1.2, top_p=0.95, top_k=3, padding=(4,)
    ),
    # The draft leaves its siblings the last 1e-9 of its mass: drawn from that, tested against it.
    "sampled tree of a sure draft": dict(
        shape=FAN_OUT, sampled=True, temperature=1.0, top_p=1.0, draft_sharpness=12.0
    ),
    "sampled tree drawn with replacement": dict(
        shape=FAN_OUT, sampled=True, temperature=0.8, top_p=1.0, replacement=True
    ),
    # A chain of 2 and 3 siblings beside it where the draft is least sure, at most 2 a level;
    # with top-p, some levels have fewer tokens than siblings (padding nodes).
    "sampled dynamic tree": dict(
        shape=SampledDynamic(depth=2, children=3, total_tokens=5),
        sampled=True,
        temperature=1.0,
        top_p=1.0,
    ),
    "sampled dynamic tree with top-p": dict(
        shape=SampledDynamic(depth=2, children=3, total_tokens=5),
        sampled=True,
        temperature=0.9,
        top_p=0.8,
    ),
    "point-mass tree with padding": dict(
        shape=INTERLEAVED, sampled=False, temperature=0.9, top_p=0.8, padding=(2,)
    ),
}


@pytest.fixture
def fresh_traces():
    """Mutations patch functions that jitted code has already traced: drop those traces."""

    def clear():
        acceptance._verify.clear_cache()
        emitted_codes.clear_cache()

    clear()
    yield
    clear()


@pytest.mark.parametrize("name", CASES)
def test_lossless(name):
    assert lossless_p_value(**CASES[name]) > P_VALUE


_reject_sampled_correct = acceptance._reject_sampled


def _q_not_kept(p, q, x, without_replacement):
    return _reject_sampled_correct(p, q, x, True)  # q as if drawn without x


def _q_kept(p, q, x, without_replacement):
    return _reject_sampled_correct(p, q, x, False)  # q as if drawn with replacement


def _top_p_on_residual(top_p):
    def target_probs(logits, temperature, _, top_k):
        return sampling_probs(logits, temperature=temperature, top_k=top_k)

    def reject_sampled(p, q, x, without_replacement):
        residual, q = _reject_sampled_correct(p, q, x, without_replacement)
        return _keep(residual, _top_p_mask(residual, top_p)), q

    return target_probs, reject_sampled


def _before_temperature(logits, temperature, top_p, top_k):
    return sampling_probs(logits, temperature=1.0, top_p=top_p, top_k=top_k)


# name: (patches of jspec.sampler.acceptance, the lossless case it breaks, tree mutation)
MUTATIONS = {
    "q not kept after rejecting an i.i.d. sibling": (
        dict(_reject_sampled=_q_not_kept),
        "sampled tree drawn with replacement",
        None,
    ),
    "q kept after rejecting a sibling drawn without replacement": (
        dict(_reject_sampled=_q_kept),
        "sampled tree",
        None,
    ),
    "siblings of the sampled dynamic tree verified as if drawn i.i.d.": (
        dict(_reject_sampled=_q_kept),
        "sampled dynamic tree",
        None,
    ),
    "top-p applied to the residual instead of the target": (
        dict(zip(("_target_probs", "_reject_sampled"), _top_p_on_residual(0.9), strict=True)),
        "sampled chain",
        None,
    ),
    "siblings drawn with replacement deduplicated": (
        dict(),
        "sampled tree drawn with replacement",
        dedup_siblings,
    ),
    "target distribution taken before temperature": (
        dict(_target_probs=_before_temperature),
        "point-mass tree",
        None,
    ),
    "rejected point-mass siblings' mass not removed": (
        dict(_point_mass_acceptance=lambda at_parent, removed, repeated: at_parent),
        "point-mass tree",
        None,
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutation_is_caught(name, monkeypatch, fresh_traces):
    """The unmutated case passes in `test_lossless`; with one rule broken it must fail."""
    patches, case, mutate_tree = MUTATIONS[name]
    for attribute, replacement in patches.items():
        monkeypatch.setattr(acceptance, attribute, replacement)
    assert lossless_p_value(**CASES[case], mutate_tree=mutate_tree) < P_VALUE


def greedy_reference(tokens, parents, target_logits):
    """Walks down from the root taking the first child equal to the target's argmax."""
    path, current = [], -1
    while True:
        best = int(np.argmax(target_logits[current + 1]))
        children = [i for i in range(len(tokens)) if parents[i] == current and tokens[i] >= 0]
        match = [i for i in children if tokens[i] == best]
        if not match:
            return path, best
        path.append(match[0])
        current = match[0]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_follows_argmax(with_draft_probs):
    b, shape = 512, FAN_OUT
    rng = np.random.default_rng(5)
    tokens = rng.integers(-1, V, (b, shape.num_nodes))  # some padding nodes
    parents = np.broadcast_to(shape.parents, tokens.shape)
    logits = rng.standard_normal((b, shape.num_nodes + 1, V), np.float32)
    draft_probs = (
        rng.dirichlet(np.ones(V), logits.shape[:2]).astype(np.float32) if with_draft_probs else None
    )
    verdict = verify(
        jax.random.key(5), tokens, parents, logits, draft_probs, temperature=0, top_p=0.5
    )
    verdict = jax.tree.map(np.asarray, verdict)
    accepted_somewhere = False
    for row in range(b):
        path, next_token = greedy_reference(tokens[row], parents[row], logits[row])
        n = len(path)
        accepted_somewhere |= n > 0
        assert verdict.num_accepted[row] == n
        np.testing.assert_array_equal(verdict.path[row], path + [-1] * (shape.num_nodes - n))
        assert verdict.next_token[row] == next_token
    assert accepted_somewhere


def test_padding_nodes_and_their_subtrees_are_never_accepted():
    """The target puts all its mass on the padded node's token: still never accepted."""
    b, shape = 4096, FAN_OUT
    tokens = np.broadcast_to([-1, 1, 2, 3, 3, 3, 3, 3, 3], (b, shape.num_nodes))
    parents = np.broadcast_to(shape.parents, tokens.shape)
    logits = np.zeros((b, shape.num_nodes + 1, V), np.float32)
    logits[:, 0, 0] = logits[:, :, 3] = 5.0
    for draft_probs in (None, np.full(logits.shape, 1 / V, np.float32)):
        verdict = verify(jax.random.key(6), tokens, parents, logits, draft_probs)
        on_path = np.asarray(verdict.path)
        assert not np.isin(on_path, [0, 3, 4]).any()
        assert (verdict.num_accepted > 0).any()


def test_equal_target_and_draft_accept_everything_and_stay_finite():
    b, shape = 1024, StaticTree.chain(5)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((b, 6, V), np.float32)
    probs = np.asarray(sampling_probs(logits, temperature=0.9, top_p=0.9))
    tokens = (rng.random((b, 5, 1)) > np.cumsum(probs[:, :5], axis=-1)).sum(-1)  # draws from p
    parents = np.broadcast_to(shape.parents, tokens.shape)
    verdict = verify(jax.random.key(7), tokens, parents, logits, probs, temperature=0.9, top_p=0.9)
    assert (verdict.num_accepted == 5).all()
    assert ((verdict.next_token >= 0) & (verdict.next_token < V)).all()


def test_residual_without_mass_falls_back_to_the_target():
    p = jnp.array([[0.25, 0.25, 0.5, 0.0]])
    np.testing.assert_array_equal(acceptance._reject_sampled(p, p, jnp.array([2]), False)[0], p)
    point = jnp.array([[0.0, 1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(acceptance._renormalise(jnp.zeros_like(point), point), point)
    q = jnp.array([[0.5, 0.25, 0.25, 0.0]])
    residual, q_after = acceptance._reject_sampled(p, q, jnp.array([0]), False)
    np.testing.assert_allclose(residual, [[0.0, 0.0, 1.0, 0.0]])
    np.testing.assert_array_equal(q_after, q)
    _, q_without = acceptance._reject_sampled(p, q, jnp.array([0]), True)
    np.testing.assert_allclose(q_without, [[0.0, 0.5, 0.5, 0.0]])
    _, q_only = acceptance._reject_sampled(p, point, jnp.array([1]), True)  # nothing left: q
    np.testing.assert_array_equal(q_only, point)
    sure = jnp.array([[1 - 1e-7, 9e-8, 1e-8, 0.0]])  # what is left is drawn from: renormalised
    _, q_rest = acceptance._reject_sampled(p, sure, jnp.array([0]), True)
    np.testing.assert_allclose(q_rest, [[0.0, 0.9, 0.1, 0.0]], rtol=1e-5)


def sequential_point_mass_walk(u, tokens, parents, p_all):
    """The walk as the rules state it, one node at a time: (path, next-token distribution)."""
    current, p, path = -1, p_all[0], []
    for i, (x, parent) in enumerate(zip(tokens, parents, strict=True)):
        if parent != current or x < 0:
            continue
        if u[i] < p[x]:
            path, current, p = path + [i], i, p_all[i + 1]
        else:
            rest = np.where(np.arange(p.size) == x, 0.0, p)
            p = rest / rest.sum() if rest.sum() > 1e-6 else p
    return path, p


def test_point_mass_walk_at_once_equals_the_walk_one_node_at_a_time():
    """Random trees (siblings anywhere in the order, repeated sibling tokens, padding nodes and
    their subtrees) and draws, and chains of every node that stop at each depth: the same path and
    the same next-token distribution."""
    b, n = 2000, 9
    rng = np.random.default_rng(11)
    parents = np.stack([rng.integers(-1, np.arange(n)) for _ in range(b)])  # parent < own index
    tokens = rng.integers(-1, V, (b, n))
    p_all = rng.dirichlet(np.full(V, 0.5), (b, n + 1)).astype(np.float32)
    u = rng.random((b, n), np.float32)
    # Rows 0..n: a chain of n valid nodes; node k (none in row n) fails its test, all others pass.
    parents[: n + 1], tokens[: n + 1] = np.arange(-1, n - 1), np.abs(tokens[: n + 1])
    u[: n + 1] = np.eye(n + 1, n, dtype=np.float32)
    path, num, p_next = map(np.asarray, acceptance._walk_point_mass(u, tokens, parents, p_all))
    lengths = []
    for row in range(b):
        want, p_want = sequential_point_mass_walk(u[row], tokens[row], parents[row], p_all[row])
        lengths.append(len(want))
        np.testing.assert_array_equal(path[row], want + [-1] * (n - len(want)))
        assert num[row] == len(want)
        np.testing.assert_allclose(p_next[row], p_want, rtol=1e-5, atol=1e-6)
    assert lengths[: n + 1] == list(range(n + 1)) and min(lengths[n + 1 :]) == 0


@pytest.mark.parametrize("without_replacement", [False, True])
def test_sampled_chain_walk_at_once_equals_the_walk_one_node_at_a_time(without_replacement):
    """Chains whose draws fail at every depth (or nowhere), with padding nodes at their ends and
    tokens the draft gave no mass: the same path and the same next-token distribution as the walk
    of any tree, and `verify` takes it (no loop) when the parents are known while tracing."""
    b, n = 2000, 6
    rng = np.random.default_rng(12)
    parents = np.broadcast_to(np.arange(-1, n - 1, dtype=np.int32), (b, n))
    tokens = rng.integers(0, V, (b, n)).astype(np.int32)
    tokens[rng.random(b) < 0.3, rng.integers(1, n)] = -1
    tokens = np.where(np.cumsum(tokens < 0, axis=1) > 0, -1, tokens)  # padding to the end
    p_all = rng.dirichlet(np.full(V, 0.5), (b, n + 1)).astype(np.float32)
    q_all = rng.dirichlet(np.full(V, 0.5), (b, n + 1)).astype(np.float32)
    q_all[rng.random((b, n + 1)) < 0.1, 0] = 0.0  # where a draft gives a token no mass
    u = rng.random((b, n), np.float32)
    args = tuple(map(jnp.asarray, (u, tokens, parents, p_all, q_all)))
    got = acceptance._walk_chain(*args[:2], *args[3:], without_replacement)
    want = acceptance._walk_sampled(*args, without_replacement)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    assert set(np.asarray(got[1]).tolist()) == set(range(n + 1))
    run = lambda u_key, tokens, probs: verify(
        u_key, tokens, parents, np.log(p_all), probs, without_replacement=without_replacement
    )
    jaxpr = str(jax.make_jaxpr(run)(jax.random.key(0), tokens, q_all))
    assert not {"scan", "while"} & set(re.findall(r"\b\w+\b", jaxpr))  # one node a step: a scan


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_nodes_take_the_next_token_at_the_root(with_draft_probs):
    logits = np.random.default_rng(8).standard_normal((3, 1, V), np.float32)
    probs = np.full(logits.shape, 1 / V, np.float32) if with_draft_probs else None
    empty = np.zeros((3, 0), np.int32)
    verdict = verify(jax.random.key(8), empty, empty, logits, probs, temperature=0)
    assert verdict.path.shape == (3, 0) and not np.asarray(verdict.num_accepted).any()
    np.testing.assert_array_equal(verdict.next_token, logits[:, 0].argmax(-1))


def test_jit_with_traced_parents_compiles_once_per_shape():
    b, n = 8, 6
    tokens = np.zeros((b, n), np.int32)
    parents = np.broadcast_to(INTERLEAVED.parents, (b, n))
    run = jax.jit(lambda key, t, par, lg: verify(key, t, par, lg, temperature=0.5, top_p=0.7))
    before = acceptance._verify._cache_size()
    for seed in range(3):
        logits = np.random.default_rng(seed).standard_normal((b, n + 1, V), np.float32)
        run(jax.random.key(seed), tokens + seed % V, parents, logits)
        verify(jax.random.key(seed), tokens + seed % V, parents, logits, temperature=0.5, top_p=0.7)
    assert run._cache_size() == 1
    assert acceptance._verify._cache_size() - before == 1


def _arguments(b=2, n=3, vocab=V):
    return dict(
        key=jax.random.key(0),
        tokens=jnp.zeros((b, n), jnp.int32),
        parents=jnp.broadcast_to(jnp.arange(-1, n - 1), (b, n)),
        target_logits=jnp.zeros((b, n + 1, vocab)),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]; pass top_p=1.0"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (
            dict(parents=jnp.array([[-1, 0, 2], [-1, 0, 1]])),
            "parents[0, 2]=2 must point to an earlier node",
        ),
        (dict(parents=jnp.array([[-1, -2, 0], [-1, 0, 1]])), "parents[0, 1]=-2 must point"),
        (dict(parents=jnp.zeros((2, 4), jnp.int32)), "tokens (2, 3) and parents (2, 4)"),
        (
            dict(target_logits=jnp.zeros((2, 3, V))),
            "target_logits (2, 3, 4) must be [batch, nodes + 1",
        ),
        (dict(draft_probs=jnp.zeros((2, 4, V + 1))), "draft_probs (2, 4, 5) must have the shape"),
        (dict(tokens=jnp.full((2, 3), V)), "a token id 4 is not in the vocabulary of size 4"),
    ],
)
def test_bad_input_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        verify(**{**_arguments(), **change})
