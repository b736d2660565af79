"""The one sampling transform: temperature, top-k and top-p over raw logits.

Plain sampling, the draft before it draws, and `jspec.sampler.verify` on the target's logits all
call `sampling_probs`, so the distribution that verification preserves is, by construction, the one
plain sampling would have drawn from. Serving engines that apply the sampling parameters in two
places have shipped drift between them (docs/sampler.md, "Why one sampling transform"); one
function removes that failure mode.
"""

import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    """Rejects sampling parameters that have no meaning, before anything is traced or compiled."""
    if not temperature >= 0:
        raise ValueError(
            f"temperature={temperature} must be >= 0; pass temperature=0 for greedy decoding"
        )
    if not 0 < top_p <= 1:
        raise ValueError(
            f"top_p={top_p} must be in (0, 1]; pass top_p=1.0 to disable nucleus sampling"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0; pass top_k=0 to disable top-k")


def _top_k_mask(probs: Float[Array, "*b v"], top_k: int) -> Bool[Array, "*b v"]:
    """Keeps every token at least as likely as the k-th most likely one (ties included)."""
    kth = jax.lax.top_k(probs, top_k)[0][..., -1:]
    return probs >= kth


def _top_p_mask(probs: Float[Array, "*b v"], top_p: float) -> Bool[Array, "*b v"]:
    """Keeps the smallest most-likely set whose mass reaches `top_p`, and every token tied with it.

    A token of sorted rank j is in the set iff the mass of ranks < j is still below `top_p`; the set
    is then widened to every token whose probability equals the smallest kept one, so the result
    does not depend on how the sort orders equal probabilities.
    """
    sorted_probs = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    smallest_kept = jnp.min(
        jnp.where(mass_before < top_p, sorted_probs, jnp.inf), axis=-1, keepdims=True
    )
    return probs >= smallest_kept


def _keep(probs: Float[Array, "*b v"], mask: Bool[Array, "*b v"]) -> Float[Array, "*b v"]:
    kept = jnp.where(mask, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def sampling_probs(
    logits: Float[Array, "*b v"],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Float[Array, "*b v"]:
    """The distribution a token is sampled from, in float32, over the last axis.

    In order: softmax(logits / temperature); top-k (`top_k=0` disables it) and renormalise; top-p
    (`top_p=1` disables it) and renormalise. Both truncations keep ties, so equal logits are
    treated alike. `temperature=0` is greedy: a point mass at the argmax (the first one among
    equal maxima), which every other rule here then leaves unchanged. The parameters are static
    Python numbers: a change of value compiles a new program, as it should for a value that selects
    code paths.
    """
    check_sampling_args(temperature, top_p, top_k)
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    probs = jax.nn.softmax(logits / temperature, axis=-1)
    if 0 < top_k < logits.shape[-1]:
        probs = _keep(probs, _top_k_mask(probs, top_k))
    if top_p < 1:
        probs = _keep(probs, _top_p_mask(probs, top_p))
    return probs


def _log(probs: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
    return jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)


def sample_from_probs(key: jax.Array, probs: Float[Array, "*b v"]) -> Int[Array, "*b"]:
    """One draw per row from `probs`; tokens of probability 0 are never drawn, so a point mass is
    drawn exactly (greedy decoding stays deterministic)."""
    return jax.random.categorical(key, _log(probs), axis=-1).astype(jnp.int32)


def sample_without_replacement(
    key: jax.Array, probs: Float[Array, "*b v"], k: int
) -> Int[Array, "*b k"]:
    """k draws per row from `probs`, one after another without replacement: the first from
    `probs`, each next one from `probs` without the tokens before it, renormalised (the k largest
    log-probabilities plus Gumbel noise, in order). Where fewer than k tokens have probability,
    the draws past them are -1."""
    scores = _log(probs) + jax.random.gumbel(key, probs.shape, jnp.float32)
    top, tokens = jax.lax.top_k(scores, k)
    return jnp.where(top > -jnp.inf, tokens, -1).astype(jnp.int32)


def sample(
    key: jax.Array,
    logits: Float[Array, "*b v"],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Int[Array, "*b"]:
    """Plain sampling: one token per row from `sampling_probs(logits, ...)`."""
    probs = sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    return sample_from_probs(key, probs)
