# %% [markdown]
# # A tour of `jspec.attention`
#
# Packed rows, a draft tree hanging off the trunk, and the same computation spread over a ring of
# (virtual) devices. Runs on a laptop CPU in seconds; CI executes it (`tests/test_notebooks.py`).
# Open it as a notebook with jupytext, or run it as a script.

# %%
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.attention import Branch, attention, context_parallel_attention, reference_attention  # noqa: E402

# %% [markdown]
# ## Packed rows
# One row holds two documents (segment ids 1 and 2) and padding (segment 0). Positions restart at
# each document. A token sees earlier tokens of its own document only.

# %%
rng = np.random.default_rng(0)
B, T, HQ, HKV, D = 1, 32, 4, 2, 16
seg = jnp.asarray([[1] * 16 + [2] * 8 + [0] * 8], jnp.int32)
pos = jnp.asarray([list(range(16)) + list(range(8)) + [0] * 8], jnp.int32)
q = jnp.asarray(rng.normal(size=(B, T, HQ, D)), jnp.float32)
k = jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32)
v = jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32)
out = attention(q, k, v, seg, pos, block_q=8, block_k=8)
print(
    "max |blockwise - dense| =", float(jnp.abs(out - reference_attention(q, k, v, seg, pos)).max())
)
print("padding rows are zero:", bool(jnp.all(out[:, 24:] == 0)))

# %% [markdown]
# ## A draft tree on the trunk
# Five nodes anchored at the last token of document 1 (index 15): a root with two children, one
# grandchild under each. A node sees document 1 up to its anchor, itself and its ancestors.

# %%
anchor = jnp.full((B, 5), 15, jnp.int32)
parent = jnp.asarray([[-1, 0, 0, 1, 2]], jnp.int32)
tree = Branch(
    q=jnp.asarray(rng.normal(size=(B, 5, HQ, D)), jnp.float32),
    k=jnp.asarray(rng.normal(size=(B, 5, HKV, D)), jnp.float32),
    v=jnp.asarray(rng.normal(size=(B, 5, HKV, D)), jnp.float32),
    anchor=anchor,
    parent=parent,
)
_, tree_out = attention(None, k, v, seg, pos, branch=tree)
_, tree_ref = reference_attention(None, k, v, seg, pos, branch=tree)
print("tree output matches the dense reference:", bool(jnp.allclose(tree_out, tree_ref, atol=1e-5)))

# %% [markdown]
# ## The same on a ring of 4 devices
# `context_parallel_attention` lays every document out in zigzag order (each of 4 ranks gets one
# early and one late chunk of each document), passes K/V around the ring and undoes the layout.
# Every document (and the padding) must be a multiple of 2 * cp = 8 tokens long.

# %%
mesh = jax.make_mesh(
    (4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
)
ring_out, ring_tree = context_parallel_attention(q, k, v, seg, pos, mesh=mesh, branch=tree)
print(
    "ring == one device:",
    bool(jnp.allclose(ring_out, out, atol=1e-5)),
    bool(jnp.allclose(ring_tree, tree_out, atol=1e-5)),
)

# %% [markdown]
# ## Gradients
# One `custom_vjp` wraps the ring; the backward runs the ring again.


# %%
def loss(q, k, v):
    return jnp.sum(context_parallel_attention(q, k, v, seg, pos, mesh=mesh) ** 2)


g_ring = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
g_ref = jax.grad(
    lambda q, k, v: jnp.sum(reference_attention(q, k, v, seg, pos) ** 2), argnums=(0, 1, 2)
)(q, k, v)
print(
    "gradients match:",
    all(bool(jnp.allclose(a, b, atol=1e-4)) for a, b in zip(g_ring, g_ref, strict=True)),
)
