"""The rollout's MLP-input kernel (`jspec.models.swiglu_input`: residual add, input norm, gate and
up products and SwiGLU, one Pallas kernel) against the model's own functions (`layers.normed_input`
and `layers.swiglu` after the add), in Pallas' interpreter on the CPU, and compiled where a GPU
runs the tests. Error: `helpers.close` (max abs difference over the reference's scale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import layers, swiglu_input
from tests.helpers import close

MODES = [True] + [False] * (jax.default_backend() == "gpu")  # interpret, and compiled on a GPU
EPS = 1e-6


def reference(x, o, w_gate_up):
    """x + o and the MLP's gated activation as a rollout step computes them in XLA."""
    h = x + o
    _, scale = layers.normed_input(h, None, EPS)
    gate_up = layers.scaled(jnp.einsum("btd,cfd->btcf", h, w_gate_up), scale)
    return h, jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("programs", [132, 2])  # the default: blocks of 16 here; 32 and 64
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "b, t, d, f",
    [(1, 1, 256, 512), (2, 3, 48, 96), (4, 16, 128, 2048)],  # 1 token, 6 (padded), 64 (a tile)
)
def test_the_kernel_adds_and_gates_as_the_model(interpret, programs, dtype, b, t, d, f):
    """The new residual stream exactly (each program writes its chunk: every chunk is written),
    the gated activation to float32's 1e-5 and to bfloat16's rounding (the kernel rounds once, the
    model after the product and after its scale), whichever block of the MLP's width a program
    takes."""
    tiling = swiglu_input.Tiling(target_programs=programs)
    keys = jax.random.split(jax.random.key(0), 3)
    x, o = (3 * jax.random.normal(k, (b, t, d)).astype(dtype) for k in keys[:2])
    w = (jax.random.normal(keys[2], (2, f, d)) / d**0.5).astype(dtype)
    assert swiglu_input.supports(b * t, d, f, tiling)
    got = swiglu_input.kernel(x, o, w, eps=EPS, interpret=interpret, tiling=tiling)
    want = reference(x, o, w)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert got[1].dtype == want[1].dtype and got[1].shape == (b, t, f)
    close(
        np.asarray(got[1], np.float32),
        np.asarray(want[1], np.float32),
        1e-5 if dtype == "float32" else 2e-2,
    )


def test_what_the_kernel_declines():
    """More than 64 tokens, axes not of whole blocks of 16, or fewer programs than chunks of the
    hidden axis (one writes each) stay in XLA."""
    assert swiglu_input.supports(64, 1024, 3072) and swiglu_input.supports(1, 16, 16)
    assert not swiglu_input.supports(65, 1024, 3072)
    assert not swiglu_input.supports(8, 1000, 3072)
    assert not swiglu_input.supports(8, 1024, 3000)
    assert not swiglu_input.supports(8, 4096, 64)  # 4 programs for 32 chunks
