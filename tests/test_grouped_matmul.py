"""The grouped matmul's custom VJP (the products of the Mosaic GPU kernels, here by `lax`) against
autodiff through `jax.lax.ragged_dot`: values and gradients, rows past the runs, an empty run.
The Mosaic kernels themselves are checked against `lax.ragged_dot` on the GPU (bench_moe)."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import close

from jspec.models.grouped_matmul import LAX, grouped_matmul


def test_custom_vjp_matches_autodiff_of_ragged_dot():
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)  # 17 rows in runs, an empty run, 3 rows past them
    x = jnp.asarray(rng.normal(size=(20, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)

    def grads(f):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (y, *vjp(dy))

    got = grads(lambda x, w, s: grouped_matmul(x, w, s, kernels=LAX))
    want = grads(jax.lax.ragged_dot)
    for g, e in zip(got, want, strict=True):
        close(g, e)
    np.testing.assert_array_equal(got[0][17:], 0)
    np.testing.assert_array_equal(got[1][17:], 0)
