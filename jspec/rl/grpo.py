"""GRPO: group-relative advantages and the clipped importance-ratio policy loss.

The ratio is taken against the sampler's own log-probabilities (`generate` returns them under the
sampling distribution), so no second forward of the old policy is needed: the train step's policy
forward gives the new log-probabilities, and with one update per rollout batch the ratio starts at
1 and the clip matters only when rollout and training numerics differ. An optional KL penalty to a
frozen reference uses the k3 estimator exp(ref - new) - (ref - new) - 1 (unbiased, >= 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jspec.models import output_head


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """(r - group mean) / (group std + eps) over consecutive groups of `group_size` responses to
    one prompt; a group whose responses all score the same gets 0. On the host, where the
    rewards are: a few eager device operations would cost more than the arithmetic."""
    r = np.asarray(rewards, np.float32).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    return (centred / (r.std(axis=1, keepdims=True) + eps)).reshape(-1)


def token_logprobs(
    hidden: Float[Array, "b t d"],
    head: Float[Array, "v d"],
    tokens: Int[Array, "b t"],
    temperature: float,
    chunks: int = 1,
    mesh: Mesh | None = None,
) -> Float[Array, "b t"]:
    """log p(token j | tokens before j) under the sampling temperature, at token j (0 at j = 0),
    from the policy's final-normed hidden states and its output head [V, D], `chunks` slices of
    the vocabulary at a time (`output_head`: the [B,T,V] logits never exist whole for chunks > 1).

    Position j - 1 predicts token j; the caller masks tokens that start a document. The tokens
    are shifted, not the hidden states: under context parallelism their sequence axis is
    sharded, where a shift would move all of it."""
    successor = jnp.maximum(jnp.roll(tokens, -1, axis=1), 0)
    picked = output_head.token_logprobs(hidden, head, successor, temperature, chunks, mesh)
    return jnp.pad(picked[:, :-1], ((0, 0), (1, 0)))


def normalize(
    per_token: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    sequence: Int[Array, "b t"],
    num_sequences: int,
    how: str,
) -> Float[Array, ""]:
    """Mean of `per_token` over the mask: over all tokens ('token'), or per sequence and then over
    the sequences that have any token ('sequence', each sequence weighs the same)."""
    x = jnp.where(mask, per_token, 0.0)
    if how == "token":
        return x.sum() / jnp.maximum(mask.sum(), 1)
    seq = jnp.where(mask, sequence, num_sequences).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(-1), seq, num_sequences + 1)[:-1]
    counts = jax.ops.segment_sum(mask.reshape(-1).astype(jnp.float32), seq, num_sequences + 1)[:-1]
    present = counts > 0
    return jnp.sum(jnp.where(present, sums / jnp.maximum(counts, 1), 0.0)) / jnp.maximum(
        present.sum(), 1
    )


def policy_loss(
    logprobs: Float[Array, "b t"],
    old_logprobs: Float[Array, "b t"],
    advantages: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    sequence: Int[Array, "b t"],
    *,
    num_sequences: int,
    clip_epsilon: float,
    normalization: str = "token",
    ref_logprobs: Float[Array, "b t"] | None = None,
    kl_coef: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The clipped surrogate -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), plus `kl_coef`
    times the k3 KL to the reference, normalised over the masked (response) tokens."""
    ratio = jnp.exp(logprobs - old_logprobs)
    clipped = jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    mean = lambda x: normalize(x, mask, sequence, num_sequences, normalization)
    metrics = {"clip_fraction": mean((ratio != clipped).astype(jnp.float32))}
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs - logprobs
        kl = jnp.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        metrics["kl"] = mean(kl)
    return mean(per_token), metrics


def sft_loss(
    logprobs: Float[Array, "b t"], mask: Bool[Array, "b t"]
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Cross-entropy of the reference responses (the SFT warm start), per token."""
    return -jnp.sum(jnp.where(mask, logprobs, 0.0)) / jnp.maximum(mask.sum(), 1), {}
