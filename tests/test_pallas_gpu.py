"""The Pallas block kernel (jspec.attention.pallas_gpu) in Pallas' interpreter, on the CPU.

Small tiles (16) so that every shape has several tiles, runs of tiles, skipped tiles, masked and
unmasked ones. Compared to `blocks.fwd` / `blocks.bwd` (the XLA block functions it replaces) and,
through `jspec.attention.attention(impl="pallas_interpret")` (the library's custom_vjp, one device
and the ring), to the dense `reference_attention`. Error is max |x - ref| / max |ref|.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pl = pytest.importorskip("jax.experimental.pallas")

from jspec.attention import (  # noqa: E402
    Branch,
    attention,
    blocks,
    context_parallel_attention,
    pallas_gpu,
    reference_attention,
)

TILES = pallas_gpu.Tiles(
    fwd=pallas_gpu.Tile(32, 16, 4, 1),
    dkdv=pallas_gpu.Tile(16, 32, 4, 1),
    dq=pallas_gpu.Tile(16, 16, 4, 1),
)
KW = dict(tiles=TILES, interpret=True)
TOL = 1e-5


def rel_err(x, ref):
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def packed(t, docs, pad):
    """One row: documents of the given lengths, then `pad` padding tokens, to length t."""
    seg, pos = np.zeros(t, np.int32), np.zeros(t, np.int32)
    start = 0
    for i, n in enumerate(docs):
        seg[start : start + n], pos[start : start + n] = i + 1, np.arange(n)
        start += n
    assert start + pad == t
    return seg, pos


def rows(*rows_):
    seg, pos = zip(*rows_, strict=True)
    return jnp.asarray(np.stack(seg)), jnp.asarray(np.stack(pos))


def normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


@pytest.fixture(scope="module")
def case():
    """B=2, T=96 (padded inside to the tiles), GQA 4/2, D=16; packed documents and padding."""
    rng = np.random.default_rng(0)
    seg, pos = rows(packed(96, [40, 37, 13], 6), packed(96, [96], 0))
    q = normal(rng, (2, 96, 4, 16))
    k, v = normal(rng, (2, 96, 2, 16)), normal(rng, (2, 96, 2, 16))
    return rng, q, k, v, seg, pos


def test_fwd_and_bwd_match_blocks(case):
    rng, q, k, v, seg, pos = case
    args = (q, k, v, seg, pos, seg, pos)
    o, lse = pallas_gpu.fwd(*args, scale=0.3, **KW)
    o_ref, lse_ref = blocks.fwd(*args, scale=0.3, block_q=32, block_k=32)
    assert rel_err(o, o_ref) < TOL
    hidden = seg == 0  # padding queries see nothing: lse -inf, output 0
    assert bool(jnp.all(jnp.isneginf(lse) == hidden[..., None]))
    assert bool(jnp.all(jnp.where(hidden[..., None, None], o, 0.0) == 0.0))
    fin = jnp.isfinite(lse_ref)
    assert float(jnp.max(jnp.abs(jnp.where(fin, lse - lse_ref, 0.0)))) < 1e-5

    do = normal(rng, o.shape)
    delta = jnp.sum(do * o_ref, axis=-1)
    got = pallas_gpu.bwd(*args, lse_ref, do, delta, scale=0.3, **KW)
    want = blocks.bwd(*args, lse_ref, do, delta, scale=0.3, block_q=32, block_k=32)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == jnp.float32
        assert rel_err(g, w) < TOL


def test_cross_attention_keys_out_of_order():
    """Keys in shuffled chunks (as on a ring step): runs with gaps, tiles seen in any order."""
    rng = np.random.default_rng(1)
    seg, pos = packed(128, [70, 58], 0)
    perm = np.concatenate([np.arange(c * 16, c * 16 + 16) for c in (5, 0, 7, 2, 1, 6, 3, 4)])
    k_seg, k_pos = jnp.asarray(seg[perm][None]), jnp.asarray(pos[perm][None])
    q_seg, q_pos = jnp.asarray(seg[None, 48:112]), jnp.asarray(pos[None, 48:112])
    q = normal(rng, (1, 64, 2, 32))
    k, v = normal(rng, (1, 128, 1, 32)), normal(rng, (1, 128, 1, 32))
    args = (q, k, v, q_seg, q_pos, k_seg, k_pos)
    o, lse = pallas_gpu.fwd(*args, scale=0.2, **KW)
    o_ref, lse_ref = blocks.fwd(*args, scale=0.2, block_q=16, block_k=16)
    assert rel_err(o, o_ref) < TOL and rel_err(lse, lse_ref) < TOL
    do = normal(rng, o.shape)
    delta = jnp.sum(do * o_ref, axis=-1)
    got = pallas_gpu.bwd(*args, lse_ref, do, delta, scale=0.2, **KW)
    want = blocks.bwd(*args, lse_ref, do, delta, scale=0.2, block_q=16, block_k=16)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < TOL


def test_attention_grads_match_reference(case):
    rng, q, k, v, seg, pos = case
    ct = normal(rng, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

    def ours(q, k, v):
        return attention(q, k, v, seg, pos, impl="pallas_interpret", tiles=TILES)

    def ref(q, k, v):
        return reference_attention(q, k, v, seg, pos)

    assert rel_err(ours(q, k, v), ref(q, k, v)) < TOL
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < TOL


def test_bfloat16_forward(case):
    _, q, k, v, seg, pos = case
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    o = attention(q, k, v, seg, pos, impl="pallas_interpret", tiles=TILES)
    assert o.dtype == jnp.bfloat16
    want = reference_attention(q, k, v, seg, pos)
    assert rel_err(o.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2


def test_plan_covers_exactly_the_visible_tiles():
    """Every (query tile, key tile) pair that may_see admits is visited once, with the mask
    exactly when some pair inside is hidden; the transposed plan visits the same pairs."""
    seg, pos = rows(packed(128, [40, 50, 20], 18))
    bq, bk = 16, 32
    for by_key in (False, True):
        plan = np.asarray(pallas_gpu._plan(seg, pos, seg, pos, bq, bk, by_key=by_key))[0]
        r = (plan.shape[-1] - 2) // 4
        vis = np.asarray(seg[0, :, None] == seg[0, None]) & np.asarray(
            (seg[0, :, None] != 0) & (pos[0, None] <= pos[0, :, None])
        )
        tiles = vis.reshape(128 // bq, bq, 128 // bk, bk).transpose(0, 2, 1, 3)
        any_, all_ = tiles.any((2, 3)), tiles.all((2, 3))
        if by_key:
            any_, all_ = any_.T, all_.T
        for o, p in enumerate(plan):
            full = [j for i in range(p[0]) for j in range(p[2 + 2 * i], p[3 + 2 * i])]
            part = [
                j for i in range(p[1]) for j in range(p[2 + 2 * r + 2 * i], p[3 + 2 * r + 2 * i])
            ]
            assert set(full) == set(np.flatnonzero(all_[o]))
            assert len(full) + len(part) == len(set(full) | set(part))
            assert set(np.flatnonzero(any_[o])) <= set(full) | set(part)


def test_available_and_supports():
    assert pallas_gpu.available() is (jax.default_backend() == "gpu")
    assert pallas_gpu.supports(128) and pallas_gpu.supports(16)
    assert not pallas_gpu.supports(96) and not pallas_gpu.supports(8)


def test_ring_with_branch_on_the_kernel():
    """The kernel inside the ring (shard_map over 2 ranks) with a draft tree: outputs and grads."""
    rng = np.random.default_rng(5)
    t, n = 64, 6
    seg = jnp.asarray([[1] * 32 + [2] * 24 + [0] * 8], jnp.int32)
    pos = jnp.asarray([list(range(32)) + list(range(24)) + [0] * 8], jnp.int32)
    q, k, v = normal(rng, (1, t, 4, 16)), normal(rng, (1, t, 2, 16)), normal(rng, (1, t, 2, 16))
    anchor = jnp.full((1, n), 31, jnp.int32)
    parent = jnp.asarray([[-1, 0, 0, 1, 3, 2]], jnp.int32)
    bqkv = (normal(rng, (1, n, 4, 16)), normal(rng, (1, n, 2, 16)), normal(rng, (1, n, 2, 16)))
    mesh = jax.make_mesh(
        (2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )

    def loss(fn):
        def f(q, k, v, bqkv):
            out, b_out = fn(q, k, v, seg, pos, branch=Branch(*bqkv, anchor, parent))
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(b_out))

        return jax.grad(f, argnums=(0, 1, 2, 3))

    kernel = dict(impl="pallas_interpret", tiles=TILES)
    ours = loss(lambda *a, **kw: context_parallel_attention(*a, mesh=mesh, **kernel, **kw))
    got = ours(q, k, v, bqkv)
    want = loss(reference_attention)(q, k, v, bqkv)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) < TOL
