"""The grouped matmul's custom VJP (the products of the Mosaic GPU kernels, here by `lax`) against
autodiff through `jax.lax.ragged_dot`: values and gradients, rows past the runs, an empty run.
The Mosaic kernels themselves are checked against `lax.ragged_dot` on the GPU (bench_moe)."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import close

from jspec.config import MeshConfig
from jspec.mesh import make_mesh
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


def test_custom_vjp_inside_shard_map_with_weights_varying_over_fewer_axes():
    """As under expert parallelism: rows vary over every mesh axis, each device's experts over one
    (the GPU run of bench_moe failed here: the weights' gradient had the wrong manual axes)."""
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(8 * 12, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.float32)
    sizes = jnp.asarray([3, 4, 2, 0], jnp.int32)  # per device: its 2 experts' runs (data shards G)
    rows, experts = jax.P(("data", "context", "tensor")), jax.P("data")

    def loss(f):
        def local(x, w, s):
            return jax.lax.psum(jnp.sum(f(x, w, s) ** 2), ("data", "context", "tensor"))

        run = jax.shard_map(local, mesh=mesh, in_specs=(rows, experts, experts), out_specs=jax.P())
        placed = (
            jax.device_put(a, jax.NamedSharding(mesh, spec))
            for a, spec in ((x, rows), (w, experts), (sizes, experts))
        )
        return jax.value_and_grad(run, argnums=(0, 1))(*placed)

    got = loss(lambda x, w, s: grouped_matmul(x, w, s, kernels=LAX))
    want = loss(jax.lax.ragged_dot)
    close(got[0], want[0])
    for g, e in zip(got[1], want[1], strict=True):
        close(g, e)
