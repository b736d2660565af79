"""Log-probabilities of chosen tokens under the output head, without the logits of the whole
vocabulary at once.

A training step needs log p(token) at every position, not the logits: [B,T,V] in float32 is the
largest array of the step (Qwen3-8B's 151,936 ids at 8K tokens: 5 GB, and as much again for its
softmax in the backward), and at long context it outgrows the model. With `chunks` > 1 the head
runs over the vocabulary in that many slices: the forward keeps a running log-sum-exp, the
backward recomputes each slice's logits from the saved hidden states (one more product the size of
the head) and folds them into the gradients, so no more than [B,T,V/chunks] exists at once.

A slice is every chunks-th row of the head (rows c, c + chunks, ...), not a contiguous block: the
head's vocabulary axis may be split over the mesh's tensor axis, and strided slices keep every
device's share in every slice, so no slice moves between devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jspec import mesh as mesh_lib


def token_logprobs(
    hidden_BTD: Float[Array, "b t d"],
    head_VD: Float[Array, "v d"],
    targets_BT: Int[Array, "b t"],
    temperature: float,
    chunks: int = 1,
    mesh: Mesh | None = None,
) -> Float[Array, "b t"]:
    """log softmax(hidden @ head.T / temperature)[target] at each position (float32). The products
    run in the hidden states' dtype with float32 accumulation, as the model's head does. `chunks`
    must divide the vocabulary; 1 materializes the logits (the fastest where they fit), sharded
    as the model's are on `mesh`."""
    if chunks < 1 or head_VD.shape[0] % chunks:
        raise ValueError(
            f"chunks={chunks} must be >= 1 and divide the vocabulary of {head_VD.shape[0]} ids."
        )
    if chunks == 1:
        z_BTV = mesh_lib.constrain(
            logits(hidden_BTD, head_VD, temperature), mesh, ("batch", "seq", "act_vocab")
        )
        # By comparison, not a gather: the gradient is then a select that fuses into the
        # softmax's, where a gather's is a scatter-add into a zeroed [B,T,V] float32 array.
        target = jnp.arange(z_BTV.shape[-1], dtype=targets_BT.dtype) == targets_BT[..., None]
        picked = jnp.sum(jnp.where(target, z_BTV, 0.0), -1)
        return picked - jax.nn.logsumexp(z_BTV, -1)
    return _chunked(hidden_BTD, head_VD, targets_BT, temperature, chunks)


def logits(hidden_BTD, head_VD, temperature: float = 1.0) -> Float[Array, "b t v"]:
    """hidden @ head.T / temperature in float32, the product in the hidden states' dtype."""
    w = head_VD.astype(hidden_BTD.dtype)
    return (
        jnp.einsum("btd,vd->btv", hidden_BTD, w, preferred_element_type=jnp.float32) / temperature
    )


def _slice(head_VD, chunks: int, c) -> Float[Array, "vc d"]:
    """Rows c, c + chunks, ... of the head."""
    v, d = head_VD.shape
    return jax.lax.dynamic_index_in_dim(head_VD.reshape(v // chunks, chunks, d), c, 1, False)


def _picked(hidden_BTD, head_VD, targets_BT, temperature: float) -> Float[Array, "b t"]:
    """The targets' logits alone: their rows of the head, one dot product a position."""
    w_BTD = jnp.take(head_VD, targets_BT, axis=0).astype(hidden_BTD.dtype)
    dot = jnp.einsum("btd,btd->bt", hidden_BTD, w_BTD, preferred_element_type=jnp.float32)
    return dot / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(hidden_BTD, head_VD, targets_BT, temperature: float, chunks: int):
    return _chunked_fwd(hidden_BTD, head_VD, targets_BT, temperature, chunks)[0]


def _chunked_fwd(hidden_BTD, head_VD, targets_BT, temperature: float, chunks: int):
    def running(carry, c):
        m, s = carry
        z = logits(hidden_BTD, _slice(head_VD, chunks, c), temperature)
        m_new = jnp.maximum(m, z.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[..., None]).sum(-1)
        return (m_new, s), None

    bt = hidden_BTD.shape[:2]
    init = (jnp.full(bt, -jnp.inf, jnp.float32), jnp.zeros(bt, jnp.float32))
    (m, s), _ = jax.lax.scan(running, init, jnp.arange(chunks))
    lse = m + jnp.log(s)
    out = _picked(hidden_BTD, head_VD, targets_BT, temperature) - lse
    return out, (hidden_BTD, head_VD, targets_BT, lse)


def _chunked_bwd(temperature: float, chunks: int, residuals, g_BT):
    """d/dh = (w[target] - sum_v p_v w_v) g / T and d/dw_v = (1[v = target] - p_v) g h / T, the
    softmax p of each slice recomputed from h and the saved log-sum-exp."""
    hidden_BTD, head_VD, targets_BT, lse = residuals
    coef = g_BT / temperature
    f32 = jnp.float32

    def one_slice(dh, c):
        w = _slice(head_VD, chunks, c).astype(hidden_BTD.dtype)
        z = logits(hidden_BTD, w, temperature)
        p = (jnp.exp(z - lse[..., None]) * coef[..., None]).astype(hidden_BTD.dtype)
        dh = dh - jnp.einsum("btv,vd->btd", p, w, preferred_element_type=f32)
        dw = jnp.einsum("btv,btd->vd", p, hidden_BTD, preferred_element_type=f32)
        return dh, (-dw).astype(head_VD.dtype)

    dh, dw = jax.lax.scan(one_slice, jnp.zeros(hidden_BTD.shape, f32), jnp.arange(chunks))
    v, d = head_VD.shape
    d_head = jnp.moveaxis(dw, 0, 1).reshape(v, d)  # slice c's row i is row i * chunks + c
    w_BTD = jnp.take(head_VD, targets_BT, axis=0).astype(f32)
    dh = dh + coef[..., None] * w_BTD
    picked = (coef[..., None] * hidden_BTD.astype(f32)).reshape(-1, d)
    d_head = d_head.at[targets_BT.reshape(-1)].add(picked.astype(head_VD.dtype))
    return dh.astype(hidden_BTD.dtype), d_head, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
