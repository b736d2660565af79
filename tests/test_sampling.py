"""The sampling transform against a float64 numpy reference written from its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square_p_value
from jax.scipy.special import gammaincc

from jspec.sampler import sample, sample_from_probs, sample_without_replacement, sampling_probs


def reference_probs(logits, temperature, top_p, top_k):
    """Softmax at temperature; keep tokens >= the k-th largest; keep the smallest most-likely set
    reaching top_p plus every token tied with its least likely member; renormalise each time."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits, axis=-1)]
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.empty_like(p)
    for row, probs in enumerate(p.reshape(-1, p.shape[-1])):
        if top_k:
            probs = np.where(probs >= np.sort(probs)[::-1][top_k - 1], probs, 0.0)
            probs /= probs.sum()
        order = np.sort(probs)[::-1]
        needed = np.searchsorted(np.cumsum(order), top_p - 1e-12) + 1  # smallest set reaching it
        probs = np.where(probs >= order[min(needed, order.size) - 1], probs, 0.0)
        out.reshape(-1, p.shape[-1])[row] = probs / probs.sum()
    return out


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.9, 0), (0.5, 0.6, 0), (1.0, 1.0, 3), (0.8, 0.7, 4)],
)
def test_matches_reference(temperature, top_p, top_k):
    logits = 2.0 * np.random.default_rng(0).standard_normal((3, 5, 11), np.float32)
    got = sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    want = reference_probs(logits, temperature, top_p, top_k)
    assert got.dtype == jnp.float32 and got.shape == logits.shape
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got) > 0, want > 0)


def test_top_p_smallest_set_and_ties():
    logits = jnp.log(jnp.array([0.4, 0.2, 0.2, 0.15, 0.05]))
    # 0.4 alone does not reach 0.5; the next token is tied with another 0.2: both are kept.
    np.testing.assert_allclose(
        sampling_probs(logits, top_p=0.5), np.array([0.4, 0.2, 0.2, 0.0, 0.0]) / 0.8, atol=1e-6
    )
    np.testing.assert_allclose(sampling_probs(logits, top_p=0.35), [1, 0, 0, 0, 0], atol=1e-6)
    kept = sampling_probs(logits, top_p=0.9) > 0
    np.testing.assert_array_equal(kept, [True, True, True, True, False])
    # top-k keeps ties at the k-th largest as well.
    np.testing.assert_array_equal(sampling_probs(logits, top_k=2) > 0, [1, 1, 1, 0, 0])


def test_greedy_is_point_mass_at_first_argmax():
    logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, 5.0]])
    probs = sampling_probs(logits, temperature=0.0, top_p=0.3, top_k=2)
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])
    draws = jax.vmap(lambda k: sample(k, logits, temperature=0))(
        jax.random.split(jax.random.key(1), 1000)
    )
    assert (draws == jnp.array([1, 0])).all()


def test_low_precision_logits_are_transformed_in_float32():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((4, 7)), jnp.bfloat16)
    probs = sampling_probs(logits, temperature=0.9, top_p=0.8)
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)


def test_sample_follows_sampling_probs():
    """Chi-square at a fixed seed over 200,000 draws; fails below p = 1e-3."""
    logits = jnp.array([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    kwargs = dict(temperature=0.8, top_p=0.9, top_k=5)
    n = 200_000
    draws = jax.jit(lambda k: sample(k, jnp.broadcast_to(logits, (n, 6)), **kwargs))(
        jax.random.key(3)
    )
    observed = np.bincount(np.asarray(draws), minlength=6)
    probs = np.asarray(sampling_probs(logits, **kwargs), np.float64)
    assert (observed[probs == 0] == 0).all()
    expected = n * probs[probs > 0]
    stat = np.sum((observed[probs > 0] - expected) ** 2 / expected)
    assert float(gammaincc((expected.size - 1) / 2, stat / 2)) > 1e-3


def test_sample_without_replacement_draws_in_order_without_repeats():
    """Ordered pairs (a, b) with probability q(a) q(b) / (1 - q(a)); past the tokens with mass,
    -1."""
    q = jnp.array([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    draws = np.asarray(
        sample_without_replacement(jax.random.key(5), jnp.broadcast_to(q, (n, 5)), 4)
    )
    assert (draws[:, 3] >= 0).all() and (draws[:, :4] != 4).all()
    pairs = draws[:, 0] * 5 + draws[:, 1]
    qa = np.asarray(q, np.float64)
    joint = (qa[:, None] * qa[None, :] / (1 - qa[:, None])) * (1 - np.eye(5))
    assert chi_square_p_value(pairs, joint.reshape(-1)) > 1e-3
    one = sample_without_replacement(jax.random.key(6), jnp.array([[0.0, 1.0, 0.0]]), 2)
    np.testing.assert_array_equal(one, [[1, -1]])


def test_sample_from_probs_never_draws_zero_probability():
    probs = jnp.array([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    keys = jax.random.split(jax.random.key(4), 2000)
    draws = jax.vmap(lambda k: sample_from_probs(k, probs))(keys)
    assert set(np.unique(draws[:, 0]).tolist()) == {1, 3}
    assert (draws[:, 1] == 2).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
        (dict(top_k=-1), "top_k=-1 must be an int >= 0"),
        (dict(top_k=2.0), "top_k=2.0 must be an int >= 0"),
    ],
)
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        sampling_probs(jnp.zeros((2, 3)), **kwargs)
