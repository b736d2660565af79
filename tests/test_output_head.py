"""`jspec.models.output_head`: log-probabilities of chosen tokens with the head over slices of the
vocabulary equal numpy's log-softmax of the whole logits, and so do their gradients (the custom
backward that recomputes each slice), in float32 and with bfloat16 hidden states, on one device
and with the head split over the mesh's tensor axis and the rows over data and context."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close, close_trees

from jspec import mesh as mesh_lib
from jspec.config import MeshConfig
from jspec.models import output_head

B, T, D, V = 2, 16, 32, 96
TEMPERATURE = 0.7


def inputs(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    head = 0.3 * jax.random.normal(k[1], (V, D))
    targets = jax.random.randint(k[2], (B, T), 0, V)
    weights = jax.random.normal(k[3], (B, T))  # a loss's cotangent of each log-probability
    return hidden, head, targets, weights


def numpy_logprobs(hidden, head, targets):
    """log softmax(h w^T / T)[target] in float64, from the bfloat16 product's float32 result."""
    w = np.asarray(head.astype(hidden.dtype).astype(jnp.float32), np.float64)
    z = np.asarray(hidden.astype(jnp.float32), np.float64) @ w.T / TEMPERATURE
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def numpy_gradients(hidden, head, targets, weights):
    """d/dh and d/dw of sum(weights * logp), by the softmax's derivative in float64."""
    h = np.asarray(hidden.astype(jnp.float32), np.float64)
    w = np.asarray(head, np.float64)
    z = h @ w.T / TEMPERATURE
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(V)[np.asarray(targets)]
    coef = (onehot - p) * np.asarray(weights)[..., None] / TEMPERATURE  # [B,T,V]
    return coef @ w, np.einsum("btv,btd->vd", coef, h)


def loss(chunks, mesh=None):
    def f(hidden, head, targets, weights):
        logp = output_head.token_logprobs(hidden, head, targets, TEMPERATURE, chunks, mesh)
        return jnp.sum(weights * logp)

    return f


@pytest.mark.parametrize("chunks", [1, 2, 8, V])
def test_slices_of_the_vocabulary_give_the_whole_softmax_and_its_gradients(chunks):
    hidden, head, targets, weights = inputs()
    got = output_head.token_logprobs(hidden, head, targets, TEMPERATURE, chunks)
    close(got, numpy_logprobs(hidden, head, targets))
    grads = jax.grad(loss(chunks), argnums=(0, 1))(hidden, head, targets, weights)
    close_trees(grads, numpy_gradients(hidden, head, targets, weights), rtol=1e-5)


def test_bfloat16_hidden_states_keep_the_head_product_in_their_dtype():
    """The products run in the hidden states' dtype as the model's head does: the sliced result
    equals the whole one to bfloat16's rounding of the gradients, and float32 log-probabilities."""
    hidden, head, targets, weights = inputs(jnp.bfloat16)
    whole, sliced = (
        output_head.token_logprobs(hidden, head, targets, TEMPERATURE, n) for n in (1, 4)
    )
    assert sliced.dtype == jnp.float32
    close(sliced, numpy_logprobs(hidden, head, targets), rtol=1e-5)
    close(whole, sliced, rtol=1e-5)
    g_whole, g_sliced = (
        jax.grad(loss(n), argnums=(0, 1))(hidden, head, targets, weights) for n in (1, 4)
    )
    assert g_sliced[0].dtype == jnp.bfloat16 and g_sliced[1].dtype == jnp.float32
    close_trees(g_sliced, g_whole, rtol=2e-2)


def test_a_head_split_over_the_tensor_axis_gives_the_one_device_result():
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, context=2, tensor=2), jax.devices()[:8])
    hidden, head, targets, weights = inputs()
    put = lambda x, names: jax.device_put(x, mesh_lib.sharding(mesh, names))  # noqa: E731
    sharded = (
        put(hidden, ("batch", "seq", None)),
        put(head, ("vocab", None)),
        put(targets, ("batch", "seq")),
        put(weights, ("batch", "seq")),
    )
    f = jax.jit(jax.value_and_grad(loss(4, mesh), argnums=(0, 1)))
    close_trees(f(*sharded), jax.value_and_grad(loss(1), argnums=(0, 1))(*inputs()))


def test_chunks_that_do_not_divide_the_vocabulary_are_refused():
    hidden, head, targets, _ = inputs()
    with pytest.raises(ValueError, match=r"chunks=5 must be >= 1 and divide the vocabulary of 96"):
        output_head.token_logprobs(hidden, head, targets, TEMPERATURE, 5)


def test_the_whole_vocabulary_backward_scatters_nothing():
    """With one chunk the targets' logits are taken by comparison with the vocabulary's ids: their
    gradient is a select beside the softmax's, where a gather's is a scatter-add into a zeroed
    [B,T,V] array."""
    hidden, head, targets, weights = inputs()

    def loss(hidden, head):
        return jnp.sum(weights * output_head.token_logprobs(hidden, head, targets, TEMPERATURE))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, head)
    assert "scatter" not in str(jaxpr), jaxpr
