"""`generate`: speculative decoding equals plain decoding (greedy, token for token), keeps the
target's law (sampling, chi-square), returns the target's log-probabilities, compiles once, and
refuses bad input before compiling.

Compilation dominates on the CPU: every test of one kind shares its shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import chained_block, chi_square_p_value, distill_draft, noisy_copy
from jax import monitoring

import jspec.sampler.acceptance as acceptance
import jspec.sampler.generation as generation
from jspec.config import (
    Bucket,
    ConfigError,
    KernelConfig,
    MeshConfig,
    ModelConfig,
    RolloutConfig,
    TreeConfig,
)
from jspec.mesh import make_mesh
from jspec.models import Transformer, create
from jspec.models.block import BlockConfig, create_block
from jspec.models.draft import Eagle3Config, Eagle3Draft, ExternalDraft, create_eagle3
from jspec.models.mtp import MTPConfig, create_mtp
from jspec.sampler import Continued, generate, sampling_probs

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_seq_len=64,
)
NEW = 13  # 1 token from the prefill, then 3 verify steps of 4 tokens (a 3-node chain + 1)
TREES = {
    "chain": TreeConfig(kind="chain", depth=3),
    "static": TreeConfig(kind="static", parents=(-1, -1, 0, 0, 1, 2), sampled=False),
    "dynamic": TreeConfig(kind="dynamic", depth=3, top_k=2, total_tokens=6),
}


def random_prompts(rows, t, seed, vocab=CONFIG.vocab_size):
    """Right-padded prompts of mixed lengths in [2, t]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, t + 1, rows).astype(np.int32)
    tokens = rng.integers(0, vocab, (rows, t)).astype(np.int32)
    return jnp.asarray(np.where(np.arange(t) < lengths[:, None], tokens, 0)), jnp.asarray(lengths)


def greedy(**kw):
    return RolloutConfig(max_new_tokens=NEW, temperature=0.0, **kw)


# The cache part of rollout attention on the Pallas kernel GPUs run, interpreted.
PALLAS_TRUNK = KernelConfig(decode_backend="pallas_interpret")


def most_staggered_eos(tokens):
    """The token whose first appearance falls at the most different steps across rows (absent
    from at least one row), so rows stop at different steps and some run to the end."""
    tokens = np.asarray(tokens)
    best, best_spread = None, 0
    for v in np.unique(tokens[:, 1:]):
        firsts = [int(np.argmax(row == v)) for row in tokens if (row[1:] == v).any()]
        if len(firsts) < len(tokens) and len(set(firsts)) > best_spread:
            best, best_spread = int(v), len(set(firsts))
    return best


@pytest.fixture(scope="module")
def target():
    return create(CONFIG, seed=0)


@pytest.fixture(scope="module")
def setup(target):
    """A target, three partly agreeing drafts, 8 test prompts, an EOS id, and plain greedy
    output."""
    prompts, lengths = random_prompts(8, 5, seed=1)
    # EAGLE-3, MTP and block drafts learn the target's greedy continuations of these prompts and
    # 120 more.
    more, more_lengths = random_prompts(120, 5, seed=2)
    train_prompts = jnp.concatenate([prompts, more])
    train_lengths = jnp.concatenate([lengths, more_lengths])
    data = generate(target, None, train_prompts, train_lengths, jax.random.key(0), greedy())
    rows = []
    host = [np.asarray(x) for x in (train_prompts, train_lengths, data.tokens)]
    for p, n, g in zip(*host, strict=True):
        rows.append(np.concatenate([p[:n], g, np.zeros(5 - n, np.int32)]))
    rows = jnp.asarray(np.stack(rows))
    distill = lambda d: distill_draft(target, d, rows, train_lengths + NEW, 100)
    drafts = {
        "eagle3": distill(create_eagle3(Eagle3Config.for_target(CONFIG), seed=0)),
        "mtp": distill(create_mtp(MTPConfig.for_target(CONFIG), seed=0)),
        "block": distill(create_block(BlockConfig.for_target(CONFIG, 4), seed=0)),
        "chained block": distill(
            create_block(BlockConfig.for_target(CONFIG, 4, chained=True), seed=0)
        ),
        "external": ExternalDraft(noisy_copy(target, 0.1)),
    }
    eos = most_staggered_eos(data.tokens[:8])
    plain = generate(target, None, prompts, lengths, jax.random.key(0), greedy(eos_id=eos))
    assert len(set(np.asarray(plain.lengths).tolist())) >= 3 and max(plain.lengths) == NEW
    return dict(
        target=target, drafts=drafts, prompts=prompts, lengths=lengths, eos=eos, plain=plain
    )


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", ["eagle3", "mtp", "external"])
def test_greedy_speculative_equals_plain(setup, kind, tree):
    s = setup
    config = greedy(eos_id=s["eos"], tree=TREES[tree])
    draft = s["drafts"][kind]
    got = generate(s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    np.testing.assert_array_equal(got.lengths, s["plain"].lengths)
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    mean = got.stats.mean_accepted_length()
    assert 1.5 <= mean <= 3, f"mean accepted length {mean}: the draft should agree only in part"
    assert not np.asarray(got.stats.failed).any()
    if tree != "chain":
        assert int(np.sum(got.stats.accepted_non_first)) > 0, "no sibling but the first accepted"


@pytest.mark.parametrize(
    "kind, tree", [("block", "chain"), ("block", "dynamic"), ("chained block", "static")]
)
def test_greedy_with_a_block_draft_equals_plain(setup, kind, tree):
    """A block draft's tree of 3 levels (its block of 4 drafted in one forward, its head at each
    level) gives plain greedy decoding's tokens, and its later positions are accepted too."""
    s = setup
    config = greedy(eos_id=s["eos"], tree=TREES[tree])
    draft = s["drafts"][kind]
    got = generate(s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    np.testing.assert_array_equal(got.lengths, s["plain"].lengths)
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    mean = got.stats.mean_accepted_length()
    assert 1.5 <= mean < 4, f"mean accepted length {mean}: the draft should agree, in part"
    assert int(got.stats.reached_depth[2]) > 0, "no third block position accepted"


def test_greedy_through_the_pallas_decode_kernel(setup):
    """Plain and speculative greedy tokens with the kernel (interpreted) equal plain decoding with
    the cache part of attention in XLA."""
    s = setup
    for draft, tree in ((None, TreeConfig()), (s["drafts"]["eagle3"], TREES["dynamic"])):
        config = greedy(eos_id=s["eos"], tree=tree, kernels=PALLAS_TRUNK)
        got = generate(s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1), config)
        np.testing.assert_array_equal(got.tokens, s["plain"].tokens)


@pytest.mark.parametrize("rows", [0, 4])
def test_rollout_on_the_training_mesh_matches_one_device(setup, rows):
    """Rows over data x context (extra data parallelism in rollout), heads over tensor; with 4
    rows for 8 prompts, refills of 4 rows (one per row shard)."""
    s = setup
    target = create(CONFIG, mesh=make_mesh(MeshConfig(data=2, context=2, tensor=2)))
    draft = ExternalDraft(noisy_copy(target, 0.1))
    config = greedy(eos_id=s["eos"], tree=TREES["static"], rows=rows)
    got = generate(target, draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    assert got.tokens.sharding.num_devices == 8
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    with pytest.raises(ConfigError, match=r"rollout.refill_rows=2 does not split over the 4"):
        config = greedy(rows=4, refill_rows=2)
        generate(target, draft, s["prompts"], s["lengths"], jax.random.key(1), config)


@pytest.mark.parametrize("kind, rows, refill", [("plain", 2, 1), ("eagle3", 3, 2)])
def test_rows_that_finish_take_the_next_prompt(setup, kind, rows, refill):
    """Fewer rows than prompts (continuous batching) give each prompt the completion, the
    log-probabilities and the steps it gets when every prompt has a row, in fewer loop steps
    than one prompt after another."""
    s = setup
    draft, tree = (None, TreeConfig()) if kind == "plain" else (s["drafts"][kind], TREES["dynamic"])
    inputs = (s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1))
    run = lambda **kw: generate(*inputs, greedy(eos_id=s["eos"], tree=tree, **kw))
    whole, got = run(), run(rows=rows, refill_rows=refill)
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    np.testing.assert_array_equal(got.lengths, s["plain"].lengths)
    np.testing.assert_allclose(got.logprobs, whole.logprobs, atol=1e-5)
    for name in ("steps", "accepted", "accepted_non_first", "failed"):
        np.testing.assert_array_equal(getattr(got.stats, name), getattr(whole.stats, name))
    steps = np.asarray(whole.stats.steps)
    assert int(whole.stats.iterations) == steps.max()
    assert np.ceil(steps.sum() / rows) <= int(got.stats.iterations) < steps.sum()
    assert got.stats.busy() == steps.sum() / (rows * int(got.stats.iterations))


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_compacted_rows_decode_as_the_whole_batch(setup, kind):
    """Buckets of 6 and 5 rows for 8 prompts (5 run to the end): the running rows move into them
    as the others end, and every prompt gets the tokens, log-probabilities and steps of the
    uncompacted batch."""
    s = setup
    draft, tree = (None, TreeConfig()) if kind == "plain" else (s["drafts"][kind], TREES["dynamic"])
    inputs = (s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1))
    run = lambda **kw: generate(*inputs, greedy(eos_id=s["eos"], tree=tree, **kw))
    whole, got = run(), run(buckets=(Bucket(6), Bucket(5)))
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    np.testing.assert_array_equal(got.lengths, s["plain"].lengths)
    np.testing.assert_allclose(got.logprobs, whole.logprobs, atol=1e-5)
    for name in ("steps", "accepted", "reached_depth", "accepted_non_first", "iterations"):
        np.testing.assert_array_equal(getattr(got.stats, name), getattr(whole.stats, name))
    assert whole.stats.row_steps.tolist() == [8 * int(whole.stats.iterations)]
    assert np.sum(got.stats.row_steps) < np.sum(whole.stats.row_steps)
    assert got.stats.busy() > whole.stats.busy()
    # Each stage's rows and tokens: 8 rows a step, then 6, then 5; every token emitted counted.
    rows, emitted = np.asarray(got.stats.row_steps), np.asarray(got.stats.emitted)
    assert rows[0] % 8 == rows[1] % 6 == rows[2] % 5 == 0 and (rows > 0).all()
    assert emitted.sum() == np.sum(got.stats.steps) + np.sum(got.stats.accepted)
    want = (np.sum(whole.stats.steps) + np.sum(whole.stats.accepted)) / (8 * whole.stats.iterations)
    assert whole.stats.tokens_per_row_step(0) == pytest.approx(want)


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_budgets_end_each_completion_at_its_own_length(setup, kind):
    """Per-prompt budgets (no end token): each completion is the unbudgeted one cut at its
    budget, through the buckets that compaction moves the rows into as the short ones end."""
    s = setup
    draft = None if kind == "plain" else s["drafts"][kind]
    inputs = (s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1))
    config = greedy(tree=TREES["chain"], buckets=(Bucket(6), Bucket(2)))
    budgets = jnp.array([1, 13, 2, 5, 13, 8, 3, 11])
    whole, got = generate(*inputs, config), generate(*inputs, config, budgets=budgets)
    np.testing.assert_array_equal(got.lengths, budgets)
    cut = np.where(np.arange(NEW) < np.asarray(budgets)[:, None], whole.tokens, -1)
    np.testing.assert_array_equal(got.tokens, cut)
    assert (np.asarray(got.stats.row_steps) > 0).all()


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_a_rollout_stopped_early_and_continued_equals_the_whole(setup, kind):
    """With keep=5 the rollout returns once at most 5 rows run (those unfinished: the 5 that run
    to the end; the bucket of 6 rows still compacts, the one of 2 is never reached); a second
    call continues them, each from its prompt and tokens so far with the budget left, beside 2
    fresh prompts: every completion's tokens and log-probabilities are the uninterrupted
    rollout's."""
    s = setup
    draft, tree = (None, TreeConfig()) if kind == "plain" else (s["drafts"][kind], TREES["dynamic"])
    config = greedy(eos_id=s["eos"], tree=tree, buckets=(Bucket(6), Bucket(2)))
    inputs = (s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1))
    whole = generate(*inputs, config)
    first = generate(*inputs, config, keep=5)
    assert len(first.stats.row_steps) == 2, "the bucket of 2 rows is below keep=5"
    unfinished = np.flatnonzero(~np.asarray(first.finished))
    assert unfinished.size == 5 and int(first.stats.iterations) < int(whole.stats.iterations)
    done = np.asarray(first.finished)
    for name in ("tokens", "lengths", "logprobs"):
        np.testing.assert_allclose(
            getattr(first, name)[done], getattr(whole, name)[done], atol=1e-5
        )
    prompts, lengths = np.asarray(s["prompts"]), np.asarray(s["lengths"])
    so_far = [
        np.concatenate([prompts[i, : lengths[i]], np.asarray(first.tokens[i, : first.lengths[i]])])
        for i in unfinished
    ]
    width = max(len(x) for x in so_far)
    continued = Continued(
        jnp.asarray(np.stack([np.pad(x, (0, width - len(x))) for x in so_far])),
        jnp.asarray([len(x) for x in so_far]),
        NEW - first.lengths[unfinished],
    )
    fresh = (s["prompts"][:2], s["lengths"][:2])
    then = generate(s["target"], draft, *fresh, jax.random.key(2), config, continued=continued)
    assert np.asarray(then.finished).all() and then.tokens.shape == (2 + unfinished.size, NEW)
    np.testing.assert_array_equal(then.tokens[:2], whole.tokens[:2])
    for j, i in enumerate(unfinished):
        had, more = int(first.lengths[i]), int(then.lengths[2 + j])
        assert had + more == int(whole.lengths[i])
        tokens = np.concatenate([first.tokens[i, :had], then.tokens[2 + j, :more]])
        np.testing.assert_array_equal(tokens, whole.tokens[i, : had + more])
        logprobs = np.concatenate([first.logprobs[i, :had], then.logprobs[2 + j, :more]])
        np.testing.assert_allclose(logprobs, whole.logprobs[i, : had + more], atol=1e-5)


def test_buckets_verify_their_own_trees(setup):
    """A chain of one node in the batch, a dynamic tree once 6 rows are left, a static one at 5:
    the greedy tokens are plain decoding's, and the deeper trees of the tail reach their depth."""
    s = setup
    buckets = (Bucket(6, TREES["dynamic"]), Bucket(5, TREES["static"]))
    config = greedy(eos_id=s["eos"], tree=TreeConfig(kind="chain", depth=1), buckets=buckets)
    draft = s["drafts"]["eagle3"]
    got = generate(s["target"], draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    assert got.stats.reached_depth.shape == (3,) and int(got.stats.reached_depth[1]) > 0


def test_compaction_on_the_training_mesh_keeps_rows_on_their_shard(setup):
    """Rows over 2 data shards (4 each; 3 and 2 of them run to the end), heads over tensor: a
    bucket of 6 rows takes 3 running rows per shard, and the tokens are plain decoding's; a
    bucket that does not split is named."""
    s = setup
    mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
    target = create(CONFIG, mesh=mesh)
    draft = ExternalDraft(noisy_copy(target, 0.1))
    config = greedy(eos_id=s["eos"], tree=TREES["chain"], buckets=(Bucket(6),))
    got = generate(target, draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    np.testing.assert_array_equal(got.tokens, s["plain"].tokens)
    assert np.sum(got.stats.row_steps) < 8 * int(got.stats.iterations)
    with pytest.raises(ConfigError, match=r"rollout.buckets\[0\].rows=3 does not split over"):
        config = greedy(buckets=(Bucket(3),))
        generate(target, draft, s["prompts"], s["lengths"], jax.random.key(1), config)
    with pytest.raises(ConfigError, match=r"3 rows decode at once \(3 prompts, rollout.rows=0\)"):
        generate(target, draft, s["prompts"][:3], s["lengths"][:3], jax.random.key(1), greedy())


def test_keep_returns_once_that_many_rows_run_however_they_crowd_a_shard(setup):
    """Rows over 2 data shards, the 4 longest completions on the first: with keep=5 and a bucket
    of 6 rows (3 a shard), the rollout returns once 5 rows run though 4 of them crowd one shard;
    the one left out of the bucket is unfinished like the others, and every completion's tokens
    so far are plain decoding's."""
    s = setup
    plain_lengths = np.asarray(s["plain"].lengths)
    order = np.argsort(-plain_lengths, kind="stable")[[0, 1, 2, 3, 5, 6, 7, 4]]
    assert (plain_lengths[order[:4]] == NEW).all() and (plain_lengths[order[4:7]] < NEW).all()
    mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
    target = create(CONFIG, mesh=mesh)
    config = greedy(eos_id=s["eos"], buckets=(Bucket(6),))
    inputs = (s["prompts"][order], s["lengths"][order], jax.random.key(1), config)
    got = generate(target, None, *inputs, keep=5)
    np.testing.assert_array_equal(np.asarray(got.finished), plain_lengths[order] < NEW)
    assert int(got.stats.iterations) < NEW - 1
    for i, j in enumerate(order):
        n = int(got.lengths[i])
        np.testing.assert_array_equal(got.tokens[i, :n], s["plain"].tokens[j, :n])
    assert (np.asarray(got.lengths)[~np.asarray(got.finished)] < NEW).all()


# ---------------------------------------------------------------------------------------------
# Sampling: the first three tokens follow the target's law exactly.

SMALL = ModelConfig(
    vocab_size=8,
    hidden_size=16,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=32,
    max_seq_len=16,
)
PROMPT = (3, 1, 4)
TRIALS = 20_000
P_VALUE = 1e-3
LOSSLESS = {
    "sampled chain": dict(
        temperature=0.8, top_p=0.85, tree=TreeConfig(kind="chain", depth=2, sampled=True)
    ),
    "point-mass dynamic tree": dict(
        temperature=1.0,
        top_p=0.8,
        tree=TreeConfig(kind="dynamic", depth=2, top_k=2, total_tokens=4, sampled=False),
    ),
    "sampled tree with siblings": dict(
        temperature=1.0, top_p=1.0, tree=TreeConfig(kind="static", parents=(-1, -1, 0, 0))
    ),
    # A chain of 2 with 2 siblings where the draft is least sure.
    "sampled dynamic tree": dict(
        temperature=0.9,
        top_p=0.9,
        tree=TreeConfig(kind="dynamic", depth=2, top_k=3, total_tokens=4),
    ),
}


@pytest.fixture(scope="module")
def small():
    target = create(SMALL, seed=1)
    return target, ExternalDraft(noisy_copy(target, 1.0, seed=1))


def forward_probs(target, prefixes, temperature, top_p):
    """The target's sampling distribution after each prompt + prefix, by the training forward."""
    t = len(PROMPT) + max(len(p) for p in prefixes)
    rows = [list(PROMPT) + list(p) for p in prefixes]
    tokens = np.array([r + [0] * (t - len(r)) for r in rows], np.int32)
    seg = (np.arange(t) < np.array([len(r) for r in rows])[:, None]).astype(np.int32)
    logits = target(jnp.asarray(tokens), jnp.asarray(seg))
    last = logits[np.arange(len(rows)), [len(r) - 1 for r in rows]]
    return np.asarray(sampling_probs(last, temperature=temperature, top_p=top_p), np.float64)


def exact_joint(target, temperature, top_p, eos=None):
    """Probability of every 3-token continuation, one token at a time from the target, coded as
    `row_codes` codes them (after `eos`, no token)."""
    v = SMALL.vocab_size
    probs = lambda prefixes: forward_probs(target, prefixes, temperature, top_p)
    first = probs([()])[0]
    second = probs([(a,) for a in range(v)])
    third = probs([(a, b) for a in range(v) for b in range(v)]).reshape(v, v, v)
    joint = np.zeros((v + 1,) * 3)
    joint[:v, :v, :v] = first[:, None, None] * second[:, :, None] * third
    if eos is not None:
        joint[:, eos] = 0
        joint[:v, eos, v] = first * second[:, eos]
        joint[eos] = 0
        joint[eos, v, v] = first[eos]
    return joint.reshape(-1)


def row_codes(tokens):
    """Each row's first 3 tokens as one number, in base vocab + 1 (the last digit: no token)."""
    base = SMALL.vocab_size + 1
    t = np.where(np.asarray(tokens)[:, :3] < 0, base - 1, np.asarray(tokens)[:, :3])
    return t[:, 0] * base**2 + t[:, 1] * base + t[:, 2]


def sample_codes(small, case, seed=0, trials=TRIALS, speculative=True):
    target, draft = small
    config = RolloutConfig(max_new_tokens=3, **case)
    prompts = jnp.broadcast_to(jnp.asarray(PROMPT, jnp.int32), (trials, len(PROMPT)))
    lengths = jnp.full((trials,), len(PROMPT), jnp.int32)
    draft = draft if speculative else None
    out = generate(target, draft, prompts, lengths, jax.random.key(seed), config)
    return row_codes(out.tokens), out


@pytest.mark.parametrize("case", LOSSLESS)
def test_speculative_sampling_is_lossless(small, case):
    check_lossless(small, LOSSLESS[case], TRIALS)


def test_sampling_with_an_mtp_head_is_lossless(small):
    """A random MTP head (its feature the target's final hidden state, its head the target's)
    drafting a sampled chain at temperature 1."""
    target = small[0]
    head = create_mtp(MTPConfig.for_target(SMALL), seed=2)
    case = dict(temperature=1.0, top_p=1.0, tree=TreeConfig(kind="chain", depth=2, sampled=True))
    check_lossless((target, head), case, TRIALS)


@pytest.mark.parametrize("chained", [False, True], ids=["parallel", "chained"])
def test_sampling_with_a_block_draft_is_lossless(small, chained):
    """A random block draft (its block of 3 drafted in one forward from the target's taps, each
    node drawn from its depth's distribution, which the chained head makes depend on the node's
    parent) proposing a sampled chain, or with the chained head a tree with siblings, at
    temperature 1."""
    target = small[0]
    plain = lambda: create_block(BlockConfig.for_target(SMALL, 3), seed=2)
    draft = chained_block(SMALL, 3, seed=2) if chained else plain()
    tree = TreeConfig(kind="static", parents=(-1, -1, 0, 1)) if chained else TreeConfig(depth=2)
    check_lossless((target, draft), dict(temperature=1.0, top_p=1.0, tree=tree), TRIALS)


def test_lossless_through_the_pallas_decode_kernel(small):
    """The same through the kernel GPUs run for the cache part of attention, interpreted (slow:
    fewer trials, the same threshold)."""
    case = dict(LOSSLESS["point-mass dynamic tree"], kernels=PALLAS_TRUNK)
    check_lossless(small, case, TRIALS // 20)


@pytest.mark.parametrize("kind", ["plain", "sampled chain"])
def test_compacted_sampling_is_lossless(small, kind):
    """The EOS is the likeliest first token, so rows end at every step and the rest move into
    buckets of fewer rows: the joint law of the first tokens is still the target's."""
    c = LOSSLESS["sampled chain"]
    eos = int(np.argmax(forward_probs(small[0], [()], c["temperature"], c["top_p"])[0]))
    buckets = (Bucket(16_000), Bucket(8_000), Bucket(2_000))
    case = dict(c, eos_id=eos, buckets=buckets)
    got, out = sample_codes(small, case, speculative=kind != "plain")
    assert np.sum(out.stats.row_steps) < TRIALS * int(out.stats.iterations)  # it compacted
    joint = exact_joint(small[0], c["temperature"], c["top_p"], eos=eos)
    assert chi_square_p_value(got, joint) > P_VALUE


def check_lossless(small, case, trials):
    codes, out = sample_codes(small, case, trials=trials)
    joint = exact_joint(small[0], case["temperature"], case["top_p"])
    assert chi_square_p_value(codes, joint) > P_VALUE
    assert out.stats.mean_accepted_length() > 1.2  # the draft's proposals are really tested
    # The log-probabilities returned are the target's, recomputed by a full forward.
    tokens = np.asarray(out.tokens[:16])
    t, p = case["temperature"], case["top_p"]
    probs = lambda i: forward_probs(small[0], [r[:i] for r in tokens], t, p)
    want = [np.log(probs(i)[np.arange(16), tokens[:, i]]) for i in range(3)]
    np.testing.assert_allclose(out.logprobs[:16], np.stack(want, axis=1), atol=1e-5)


def test_a_verifier_that_skips_top_p_is_caught(small, monkeypatch):
    """The chi-square test has the power to see a verifier that ignores top-p."""
    c = LOSSLESS["sampled chain"]
    skip_top_p = lambda logits, temperature, top_p, top_k: sampling_probs(
        logits, temperature=temperature, top_k=top_k
    )
    monkeypatch.setattr(acceptance, "_target_probs", skip_top_p)
    for f in (acceptance._verify, generation._generate):
        f.clear_cache()
    try:
        codes, _ = sample_codes(small, c)
    finally:
        for f in (acceptance._verify, generation._generate):
            f.clear_cache()
    assert chi_square_p_value(codes, exact_joint(small[0], c["temperature"], c["top_p"])) < P_VALUE


# ---------------------------------------------------------------------------------------------
# An identical draft; compilation.


def test_identical_draft_accepts_everything_and_generate_compiles_once(setup):
    target = setup["target"]
    config = RolloutConfig(max_new_tokens=NEW, temperature=1.0, tree=TREES["chain"])
    before = generation._generate._cache_size()
    for seed in (3, 4):
        prompts, lengths = random_prompts(8, 5, seed=seed)
        key = jax.random.key(seed)
        out = generate(target, ExternalDraft(target), prompts, lengths, key, config)
        np.testing.assert_array_equal(out.stats.steps, 3)
        np.testing.assert_array_equal(out.stats.accepted, 9)
        np.testing.assert_array_equal(out.lengths, NEW)
    assert generation._generate._cache_size() - before == 1


def test_compile_generate_leaves_generate_nothing_to_compile(setup):
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(event) if "backend_compile" in event else None
    )
    s, config = setup, greedy(rows=4)
    args = (s["target"], None, s["prompts"], s["lengths"], jax.random.key(0), config)
    generation.compile_generate(*args)
    assert compiles, "compile_generate compiled nothing"
    compiles.clear()
    out = generate(*args)
    assert not compiles, "generate compiled again"
    np.testing.assert_array_equal(out.tokens[:, :4], setup["plain"].tokens[:, :4])


# ---------------------------------------------------------------------------------------------
# Bad input.


RNGS = nnx.Rngs(0)


def eagle3_for(target, **changes):
    """A random EAGLE-3 draft for `target`, built eagerly (no compilation)."""
    config = dataclasses.replace(Eagle3Config.for_target(target), **changes)
    return Eagle3Draft(config, rngs=RNGS)


BAD = {
    "prompt longer than the cache": (dict(max_new_tokens=60), None, r"need a cache of 65 slots"),
    "tree beyond the verify budget": (
        dict(tree=TreeConfig(depth=10, verify_budget=8)),
        None,
        r"tree of 10 nodes exceeds rollout.tree.verify_budget=8",
    ),
    "negative rows": (dict(rows=-1), None, r"rollout.rows=-1 must be >= 0"),
    "refill beyond the rows": (
        dict(rows=2, refill_rows=3),
        None,
        r"rollout.refill_rows=3 exceeds rollout.rows=2",
    ),
    "top_p of 0": (dict(top_p=0.0), None, r"rollout.top_p=0.0 must be in \(0, 1\]"),
    "top_p above 1": (dict(top_p=1.5), None, r"rollout.top_p=1.5 must be in \(0, 1\]"),
    "negative temperature": (dict(temperature=-1.0), None, r"temperature=-1.0 must be >= 0"),
    "EOS outside the vocabulary": (dict(eos_id=64), None, r"eos_id=64 is not a token"),
    "prompt token outside the vocabulary": (
        dict(prompt_token=64),
        None,
        r"prompts\[1, 0\]=64 is not a token id of the model's vocabulary \[0, 64\)",
    ),
    "draft of another width": (
        {},
        lambda: eagle3_for(dataclasses.replace(CONFIG, hidden_size=48)),
        r"hidden_size=48 differs from the target's 32",
    ),
    "draft fusing two taps": ({}, lambda: eagle3_for(CONFIG, num_taps=2), r"fuses 2 taps"),
    "draft vocabulary map of another target": (
        {},
        lambda: eagle3_for(dataclasses.replace(CONFIG, vocab_size=80)),
        r"maps its vocabulary into 80 target tokens",
    ),
    "external draft with another tokenizer": (
        {},
        lambda: ExternalDraft(Transformer(dataclasses.replace(CONFIG, vocab_size=32), rngs=RNGS)),
        r"vocab_size=32 differs",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_named(target, name):
    changes, make_draft, message = BAD[name]
    prompts, lengths = random_prompts(2, 5, seed=0)
    changes = dict(changes)
    if "prompt_token" in changes:  # a token id in the second prompt
        prompts = prompts.at[1, 0].set(changes.pop("prompt_token"))
    with pytest.raises((ConfigError, ValueError), match=message):
        config = RolloutConfig(**{"max_new_tokens": 4, **changes})
        draft = make_draft and make_draft()
        generate(target, draft, prompts, lengths, jax.random.key(0), config)


CONTINUED_BAD = {
    "a budget of 0": (dict(budgets=[0]), {}, r"continued\[0\]: length 3 and budget 0"),
    "past the cache": (dict(lengths=[7], budgets=[4]), {}, r"continued\[0\]: length 7 and"),
    "keep of every row": ({}, dict(keep=3), r"keep=3 must be in \[0, 3\)"),
}


@pytest.mark.parametrize("name", CONTINUED_BAD)
def test_bad_continued_rows_are_named(target, name):
    """Continued completions whose budget or length does not fit the caches (2-token prompts and
    4 new tokens: 6 slots), and a `keep` of every row, are refused before compiling."""
    changes, kwargs, message = CONTINUED_BAD[name]
    prompts, lengths = random_prompts(2, 2, seed=0)
    fields = dict(tokens=jnp.ones((1, 5), jnp.int32), lengths=[3], budgets=[2]) | changes
    continued = Continued(*(jnp.asarray(fields[f]) for f in Continued._fields))
    with pytest.raises(ValueError, match=message):
        config = RolloutConfig(max_new_tokens=4)
        generate(
            target, None, prompts, lengths, jax.random.key(0), config, continued=continued, **kwargs
        )


@pytest.mark.parametrize(
    "budgets, message",
    [([2, 0], r"budgets\[1\]=0 is outside \[1, 13\]"), ([2, 3, 4], r"budgets \(3,\) must be")],
)
def test_bad_budgets_are_named(target, budgets, message):
    prompts, lengths = random_prompts(2, 5, seed=0)
    with pytest.raises(ValueError, match=message):
        generate(target, None, prompts, lengths, jax.random.key(0), greedy(), budgets=budgets)


@pytest.mark.parametrize("bad", [0, 6])
def test_prompt_length_out_of_range_is_named(target, bad):
    prompts, _ = random_prompts(2, 5, seed=0)
    with pytest.raises(ValueError, match=rf"prompt_lengths\[1\]={bad} is outside \[1, 5\]"):
        generate(target, None, prompts, jnp.array([3, bad]), jax.random.key(0), greedy())
