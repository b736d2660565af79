"""The rollout's q/k/v epilogue kernel (`jspec.models.qkv_epilogue`: norms, rotary and cache
writes after the fused product, one Pallas kernel) against the model's own functions
(`cache.finish_and_write`), in Pallas' interpreter on the CPU, and compiled where a GPU runs the
tests. Error: `helpers.close` (max abs difference over the reference's scale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import qkv_epilogue
from jspec.models.cache import finish_and_write
from tests.helpers import close

B, T, K, G, E, S = 2, 3, 2, 3, 32, 8
D = 3 * 64  # the product's input: chunks of 64 in the kernel's sum of squares
MODES = [True] + [False] * (jax.default_backend() == "gpu")  # interpret, and compiled on a GPU


def inputs(dtype, seed=0, normed=True, folded=True):
    """A product [B,T,K,G+2,E], its input, a joint norm, rotary angles, caches and slots: row 0
    writes slots 2..4, row 1 slot 6 and two past the end (dropped, as `KVCache.slots` gives)."""
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda shape, dt=jnp.float32: jax.random.normal(next(keys), shape, dt)
    e = E if jax.default_backend() != "gpu" else 128
    angles = normal((B, T, 1, e // 2))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    cos_sin = (jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1))
    return dict(
        qkv=normal((B, T, K, G + 2, e), dtype),
        rms_input=normal((B, T, D), dtype) * 3 if folded else None,
        norm=(1 + 0.3 * normal((G + 2, e))).astype(dtype) if normed else None,
        cos_sin=cos_sin,
        slot=jnp.array([[2, 3, 4], [6, S, S + 1]], jnp.int32),
        k_cache=normal((B, K, S, e), dtype),
        v_cache=normal((B, K, S, e), dtype),
    )


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("head_programs", [False, True])
@pytest.mark.parametrize(
    "dtype, normed, folded",
    [
        ("float32", True, True),
        ("float32", False, True),
        ("float32", False, False),
        ("bfloat16", True, True),
        ("bfloat16", False, False),
    ],
)
def test_the_kernel_finishes_and_writes_as_the_model(
    interpret, head_programs, dtype, normed, folded
):
    """q rotated in the queries' layout, k rotated and v written at their slots (the slot past
    the end dropped, every other slot untouched), the product scaled by 1 / RMS of its input (the
    folded input norm) and normed: float32 to 1e-5, bfloat16 to its rounding (the kernel rounds
    once, the model after each step); with a program a row or a KV head."""
    args = inputs(jnp.dtype(dtype), normed=normed, folded=folded)
    want = finish_and_write(**args, eps=1e-6)
    got = qkv_epilogue.kernel(**args, eps=1e-6, interpret=interpret, head_programs=head_programs)
    rtol = 1e-5 if dtype == "float32" else 2e-2
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        close(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol)
    untouched = np.ones((B, S), bool)
    untouched[0, 2:5] = untouched[1, 6] = False
    for g, old in zip(got[1:], (args["k_cache"], args["v_cache"]), strict=True):
        np.testing.assert_array_equal(
            np.asarray(g)[untouched.nonzero()[0], :, untouched.nonzero()[1]],
            np.asarray(old)[untouched.nonzero()[0], :, untouched.nonzero()[1]],
        )
