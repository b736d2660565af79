"""jspec.attention against the dense reference: one device and the ring for cp in 1, 2, 4, 8, on
the XLA blocks and (cp 1, 2, 4) on the Pallas TPU kernel in the interpreter.

Error is max |x - ref| / max |ref| over outputs and every gradient, in float32, under 1e-5.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.attention import (
    Branch,
    attention,
    blocks,
    context_parallel_attention,
    decode,
    masks,
    mosaic_gpu,
    pallas_decode,
    pallas_tpu,
    pallas_tpu_decode,
    reference_attention,
    ring_attention,
    zigzag,
    zigzag_shard,
    zigzag_unshard,
)

TOL = 1e-5
HQ, HKV, D = 4, 2, 8
AUTO = jax.sharding.AxisType.Auto
BLOCKS = dict(block_q=16, block_k=16)
TPU = dict(impl="pallas_tpu_interpret", tiles=pallas_tpu.Tiles(16, 16))


def kernels(*cases):
    """pytest params (cp, kernel arguments): the XLA blocks, and the TPU kernel for cp in "tpu"."""
    xla = [pytest.param(cp, BLOCKS, id=f"xla-cp{cp}") for cp in cases[0]]
    return xla + [pytest.param(cp, TPU, id=f"tpu-cp{cp}") for cp in cases[1]]


def packed_rows(rng, b, t, align):
    """Segment ids and positions of rows packed with documents of random lengths, then padding."""
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for row in range(b):
        start, doc = 0, 1
        while start < t:
            length = int(rng.integers(1, 5)) * align * int(rng.integers(1, 4))
            length = min(length, t - start)
            if doc > 1 and (rng.random() < 0.15 or t - start < 2 * align):
                break  # the rest of the row is padding
            seg[row, start : start + length] = doc
            pos[row, start : start + length] = np.arange(length)
            start, doc = start + length, doc + 1
    return jnp.asarray(seg), jnp.asarray(pos)


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def rel_err(x, ref):
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        assert rel_err(g, w) < TOL, rel_err(g, w)


def value_and_grads(fn, q, k, v, branch_qkv, make_branch):
    """Outputs and the gradients of a nonlinear scalar of them w.r.t. every float input."""

    def loss(q, k, v, bqkv):
        out = fn(q, k, v, branch=None if bqkv is None else make_branch(*bqkv))
        outs = [o for o in jax.tree.leaves(out)]
        return sum(jnp.sum(jnp.sin(3.0 * o) * o) for o in outs), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True, allow_int=True)(
        q, k, v, branch_qkv
    )
    return out, [g for g in grads if g is not None]


def context_mesh(cp):
    return jax.make_mesh((8 // cp, cp), ("data", "context"), axis_types=(AUTO, AUTO))


def both(cp, seg, pos, kernel=BLOCKS):
    """The reference and the implementation under test for self-attention over packed rows."""
    ref = functools.partial(reference_attention, segment_ids=seg, positions=pos)
    if cp == 1:
        impl = functools.partial(attention, segment_ids=seg, positions=pos, **kernel)
    else:
        impl = functools.partial(
            context_parallel_attention,
            segment_ids=seg,
            positions=pos,
            mesh=context_mesh(cp),
            **kernel,
        )
    return ref, impl


@pytest.mark.parametrize("cp, kernel", kernels([1, 2, 4, 8], [1, 2, 4]))
def test_trunk_packed_gqa(cp, kernel):
    rng = np.random.default_rng(cp)
    b, t = 2, 128
    seg, pos = packed_rows(rng, b, t, 2 * cp)
    q, k, v = normal(rng, b, t, HQ, D), normal(rng, b, t, HKV, D), normal(rng, b, t, HKV, D)
    ref, impl = both(cp, seg, pos, kernel)
    want = value_and_grads(ref, q, k, v, None, None)
    got = value_and_grads(impl, q, k, v, None, None)
    assert_close(got, want)


def ttt_branch(rng, seg, steps):
    """Training-time test: node (t, s) anchored at t, parent (t, s-1); queries of the last step."""
    b, t = seg.shape
    n = t * steps
    anchor = jnp.tile(jnp.where(seg > 0, jnp.arange(t), -1), (1, steps))
    node = jnp.arange(n)
    parent = jnp.broadcast_to(jnp.where(node >= t, node - t, -1), (b, n))
    query_nodes = jnp.broadcast_to((steps - 1) * t + jnp.arange(t), (b, t))
    bqkv = (normal(rng, b, t, HQ, D), normal(rng, b, n, HKV, D), normal(rng, b, n, HKV, D))
    return bqkv, lambda bq, bk, bv: Branch(bq, bk, bv, anchor, parent, query_nodes)


@pytest.mark.parametrize(
    "cp, steps, kernel",
    [(cp, s, BLOCKS) for cp, s in [(1, 1), (1, 6), (2, 2), (2, 6), (4, 3), (8, 1), (8, 6)]]
    + [(cp, s, TPU) for cp, s in [(1, 6), (2, 2), (4, 3)]],
)
def test_training_time_test_steps(cp, steps, kernel):
    """Each step is one call with the branch K/V of steps 1..s and the queries of step s only."""
    rng = np.random.default_rng(10 * cp + steps)
    b, t = 2, 64
    seg, pos = packed_rows(rng, b, t, 2 * cp)
    k, v = normal(rng, b, t, HKV, D), normal(rng, b, t, HKV, D)
    bqkv, make = ttt_branch(rng, seg, steps)
    ref, impl = both(cp, seg, pos, kernel)
    want = value_and_grads(ref, None, k, v, bqkv, make)
    got = value_and_grads(impl, None, k, v, bqkv, make)
    assert_close(got, want)


def random_tree(rng, b, n, seg):
    """Random trees of n nodes per row, anchored at the last token of a random document; a few
    padding nodes (anchor -1) at the end."""
    anchor = np.full((b, n), -1, np.int32)
    parent = np.full((b, n), -1, np.int32)
    seg = np.asarray(seg)
    for row in range(b):
        ends = [
            i
            for i in range(seg.shape[1])
            if seg[row, i] and (i + 1 == seg.shape[1] or seg[row, i + 1] != seg[row, i])
        ]
        root = int(rng.choice(ends))
        live = n - int(rng.integers(0, 4))
        anchor[row, :live] = root
        for i in range(1, live):
            parent[row, i] = int(rng.integers(-1, i))
    return jnp.asarray(anchor), jnp.asarray(parent)


@pytest.mark.parametrize("cp, kernel", kernels([1, 2, 4, 8], [1, 2, 4]))
def test_random_trees_with_trunk(cp, kernel):
    rng = np.random.default_rng(100 + cp)
    b, t, n = 2, 64, 64
    seg, pos = packed_rows(rng, b, t, 2 * cp)
    q, k, v = normal(rng, b, t, HQ, D), normal(rng, b, t, HKV, D), normal(rng, b, t, HKV, D)
    anchor, parent = random_tree(rng, b, n, seg)
    bqkv = (normal(rng, b, n, HQ, D), normal(rng, b, n, HKV, D), normal(rng, b, n, HKV, D))
    make = lambda bq, bk, bv: Branch(bq, bk, bv, anchor, parent)  # noqa: E731
    ref, impl = both(cp, seg, pos, kernel)
    want = value_and_grads(ref, q, k, v, bqkv, make)
    got = value_and_grads(impl, q, k, v, bqkv, make)
    assert_close(got, want)
    # Padding nodes see nothing: their output is exactly zero.
    out = got[0][1]
    assert jnp.all(jnp.where((anchor < 0)[..., None, None], out, 0.0) == 0.0)


# ---------------------------------------------------------------------------------------------
# Call styles, as a user makes them: eager or under jit, Explicit or Auto mesh axes, and the three
# ways to differentiate.

EXPLICIT = jax.sharding.AxisType.Explicit


def loss_of(out):
    return sum(jnp.sum(jnp.sin(3.0 * o) * o) for o in jax.tree.leaves(out))


def differentiate(how, fn, args):
    """fn(*args) and the gradients of `loss_of` it w.r.t. every arg, by jax.`how`."""
    argnums = tuple(range(len(args)))
    if how == "value_and_grad":
        (_, out), grads = jax.value_and_grad(
            lambda *a: (loss_of(fn(*a)), fn(*a)), argnums, has_aux=True
        )(*args)
    elif how == "grad":
        out, grads = fn(*args), jax.grad(lambda *a: loss_of(fn(*a)), argnums)(*args)
    else:
        out, pullback = jax.vjp(fn, *args)
        grads = pullback(jax.grad(loss_of)(out))
    return out, grads


HOWS = ("value_and_grad", "grad", "vjp")


def trunk_and_tree_inputs(rng, b, t, n):
    """(q, k, v) of t trunk tokens and (q, k, v) of n branch nodes: every float input."""
    return tuple(normal(rng, b, length, heads, D) for length in (t, n) for heads in (HQ, HKV, HKV))


def with_tree(attend, seg, pos, anchor, parent, **kw):
    """`attend` over packed rows and a tree, as a function of `trunk_and_tree_inputs`."""

    def fn(q, k, v, bq, bk, bv):
        return attend(q, k, v, seg, pos, branch=Branch(bq, bk, bv, anchor, parent), **kw)

    return fn


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_context_parallel_call_styles(axis_type):
    """Plain arrays in, a mesh of either axis type: eager and jit, every way to differentiate."""
    rng = np.random.default_rng(5)
    b, t, n = 2, 16, 6
    seg, pos = packed_rows(rng, b, t, 4)
    anchor, parent = random_tree(rng, b, n, seg)
    mesh = jax.make_mesh(
        (2, 2), ("data", "context"), axis_types=(axis_type,) * 2, devices=jax.devices()[:4]
    )
    args = trunk_and_tree_inputs(rng, b, t, n)
    ref = with_tree(reference_attention, seg, pos, anchor, parent)
    want = jax.jit(functools.partial(differentiate, "grad", ref))(args)
    fn = with_tree(context_parallel_attention, seg, pos, anchor, parent, mesh=mesh, **BLOCKS)
    for how in HOWS:
        assert_close(differentiate(how, fn, args), want)
    for how in ("value_and_grad", "vjp"):  # grad compiles as value_and_grad does
        assert_close(jax.jit(functools.partial(differentiate, how, fn))(args), want)
    # Inputs already on the mesh, rows split over "data": on an Explicit mesh the outputs keep it.
    rows = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(differentiate, "value_and_grad", fn))(
            jax.device_put(args, rows)
        )
    if axis_type == EXPLICIT:
        assert all(o.sharding.is_equivalent_to(rows, o.ndim) for o in got[0])
    assert_close(jax.device_get(got), want)


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_ring_attention_in_a_users_shard_map(axis_type):
    """ring_attention in shard_map as a user writes it (check_vma on), the zigzag rows placed on
    the mesh: eager and under jit, differentiated."""
    rng = np.random.default_rng(6)
    b, t, cp = 2, 16, 2
    seg, pos = packed_rows(rng, b, t, 2 * cp)
    args = trunk_and_tree_inputs(rng, b, t, 0)[:3]
    mesh = jax.make_mesh((cp,), ("context",), axis_types=(axis_type,), devices=jax.devices()[:cp])
    rows = P(None, "context")
    local = functools.partial(ring_attention, axis_name="context", **BLOCKS)
    ring = jax.shard_map(local, mesh=mesh, in_specs=rows, out_specs=rows)

    def fn(q, k, v):
        placed = (
            jax.device_put(zigzag_shard(x, seg, cp), NamedSharding(mesh, rows))
            for x in (q, k, v, seg, pos)
        )
        return zigzag_unshard(ring(*placed), seg, cp)

    want = differentiate("grad", lambda q, k, v: reference_attention(q, k, v, seg, pos), args)
    with jax.set_mesh(mesh):  # jax differentiates arrays on an Explicit mesh eagerly only in it
        eager = differentiate("value_and_grad", fn, args)
        jitted = jax.jit(functools.partial(differentiate, "vjp", fn))(args)
    assert_close(jax.device_get(eager), want)
    assert_close(jax.device_get(jitted), want)


def test_decode_queries_single_device():
    """Decode: one query per row against a cache holding a few documents and empty slots."""
    rng = np.random.default_rng(7)
    b, s = 3, 80
    seg, pos = packed_rows(rng, b, s, 4)
    k, v = normal(rng, b, s, HKV, D), normal(rng, b, s, HKV, D)
    q = normal(rng, b, 1, HQ, D)
    q_seg = seg[:, :1]  # continue the first document of each row
    q_pos = jnp.max(jnp.where(seg == q_seg, pos, 0), axis=1, keepdims=True) + 1
    kw = dict(q_segment_ids=q_seg, q_positions=q_pos)
    ref = functools.partial(reference_attention, segment_ids=seg, positions=pos, **kw)
    impl = functools.partial(attention, segment_ids=seg, positions=pos, **kw, **BLOCKS)
    assert_close(
        value_and_grads(impl, q, k, v, None, None), value_and_grads(ref, q, k, v, None, None)
    )


# The Pallas trunk in blocks of 16 slots over several splits of the cache per row.
SMALL_TILING = pallas_decode.Tiling(block_k=16, target_programs=4 * 3 * HKV)


@pytest.mark.parametrize(
    "impl, heads_major, options",
    [
        ("decode", False, decode.DecodeOptions(backend="xla")),
        ("decode", True, decode.DecodeOptions(backend="xla", chunk=24, summed_pairs=0)),
        ("xla", True, None),
        ("decode", True, decode.DecodeOptions(backend="pallas_interpret", tiling=SMALL_TILING)),
        ("decode", True, decode.DecodeOptions(backend="pallas_tpu_interpret")),
    ],
)
def test_decode_impl_matches_reference(impl, heads_major, options):
    """impl='decode' (rollouts): decode queries, and a verification tree over a packed cache,
    values and gradients; a small chunk exercises the online softmax across cache chunks. A
    heads-major cache (`heads_major`, [B,Hkv,S,D]) gives the same, on every path. The Pallas
    trunk (interpreted) runs in blocks of 16 slots over several splits of the cache per row; the
    TPU kernel (interpreted) pads the cache to its one block of 128 slots. The tree's part is
    summed in place, or (`summed_pairs` 0) computed as matrix products."""
    rng = np.random.default_rng(11)
    b, s, n = 3, 80, 7
    seg, pos = packed_rows(rng, b, s, 4)
    k, v = normal(rng, b, s, HKV, D), normal(rng, b, s, HKV, D)
    q = normal(rng, b, 2, HQ, D)
    q_seg = jnp.concatenate([seg[:, :1], jnp.zeros((b, 1), jnp.int32)], axis=1)  # 2nd: padding
    q_pos = jnp.max(jnp.where(seg == seg[:, :1], pos, 0), axis=1, keepdims=True) + 1
    kw = dict(q_segment_ids=q_seg, q_positions=jnp.concatenate([q_pos, q_pos], axis=1))
    anchor, parent = random_tree(rng, b, n, seg)
    make_branch = lambda bq, bk, bv: Branch(bq, bk, bv, anchor, parent)
    branch_qkv = tuple(normal(rng, b, n, h, D) for h in (HQ, HKV, HKV))
    ref = functools.partial(reference_attention, segment_ids=seg, positions=pos, **kw)
    paths = dict(impl=impl, heads_major=heads_major, decode_options=options)
    got = functools.partial(attention, segment_ids=seg, positions=pos, **kw, **paths)
    if heads_major:
        got = lambda q, k, v, attend=got, **kw: attend(
            q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), **kw
        )
    assert_close(
        value_and_grads(got, q, k, v, branch_qkv, make_branch),
        value_and_grads(ref, q, k, v, branch_qkv, make_branch),
    )


@pytest.mark.parametrize("cp", [2, 8])
def test_ring_decode_queries(cp):
    """ring_attention inside shard_map: every rank holds the same decode queries, its own keys."""
    rng = np.random.default_rng(cp)
    b, s = 2, 64
    seg, pos = packed_rows(rng, b, s, 2 * cp)
    k, v = normal(rng, b, s, HKV, D), normal(rng, b, s, HKV, D)
    q = normal(rng, b, 1, HQ, D)
    q_seg = seg[:, :1]  # a query inside the first document: the position rule hides its tail
    q_pos = jnp.max(jnp.where(seg == q_seg, pos, 0), axis=1, keepdims=True) // 2
    mesh = jax.make_mesh((cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    kv_spec, rep = P(None, "context"), P()

    @jax.jit
    def ring(q, k, v, seg, pos):
        def local(q, k, v, seg, pos):
            return ring_attention(
                q,
                k,
                v,
                seg,
                pos,
                axis_name="context",
                q_segment_ids=q_seg,
                q_positions=q_pos,
                **BLOCKS,
            )

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rep, kv_spec, kv_spec, kv_spec, kv_spec),
            out_specs=rep,
            check_vma=False,
        )(q, k, v, seg, pos)

    got = ring(q, k, v, seg, pos)  # natural order: any order of the keys gives the same output
    want = reference_attention(q, k, v, seg, pos, q_segment_ids=q_seg, q_positions=q_pos)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_ancestor_mask_matches_walking_up_each_node(n):
    """Random forests whose nodes come in any order (a parent may follow its child)."""
    rng = np.random.default_rng(n)
    parents = []
    for _ in range(4):
        order = rng.permutation(n)  # node order[i]'s parent is one of order[:i], or none
        parent = np.full(n, -1)
        for i in range(1, n):
            parent[order[i]] = order[rng.integers(0, i)] if rng.random() < 0.8 else -1
        parents.append(parent)
    want = np.zeros((4, n, n), bool)
    for b, parent in enumerate(parents):
        for i in range(n):
            j = i
            while j >= 0:
                want[b, i, j], j = True, parent[j]
    np.testing.assert_array_equal(masks.ancestor_mask(jnp.asarray(np.stack(parents))), want)


def test_zigzag_roundtrip_and_balance():
    rng = np.random.default_rng(3)
    cp = 4
    seg, _ = packed_rows(rng, 2, 256, 2 * cp)
    x = jnp.broadcast_to(jnp.arange(256), (2, 256))
    sharded = zigzag_shard(x, seg, cp)
    assert jnp.array_equal(zigzag_unshard(sharded, seg, cp), x)
    # Every rank holds the same number of tokens of every document.
    seg_sharded = np.asarray(zigzag_shard(seg, seg, cp)).reshape(2, cp, -1)
    for doc in np.unique(np.asarray(seg)):
        counts = (seg_sharded == doc).sum(axis=2)
        assert (counts == counts[:, :1]).all()


def test_misaligned_document_is_named():
    seg = jnp.asarray([[1] * 8 + [2] * 6 + [0] * 2])
    pos = jnp.asarray([list(range(8)) + list(range(6)) + [0, 0]])
    k = jnp.zeros((1, 16, HKV, D))
    with pytest.raises(ValueError, match=r"segment id 2 in row 0 \(tokens 8\.\.13, length 6\)"):
        context_parallel_attention(k, k, k, seg, pos, mesh=context_mesh(2))


def test_misaligned_row_under_jit_is_nan_and_leaves_other_rows_exact():
    """Under jit the ids are abstract: the row holding a misaligned document is NaN (gradients
    zero); the rows beside it keep exact outputs and gradients, tree included."""
    rng = np.random.default_rng(9)
    b, t, n = 3, 16, 5
    seg, pos = packed_rows(rng, b, t, 4)
    seg = seg.at[1].set(jnp.asarray([1] * 6 + [2] * 10))  # 6 is not a multiple of 2 * cp = 4
    pos = pos.at[1].set(jnp.asarray(list(range(6)) + list(range(10))))
    anchor, parent = random_tree(rng, b, n, seg)
    args = trunk_and_tree_inputs(rng, b, t, n)
    ref = with_tree(reference_attention, seg, pos, anchor, parent)
    want = jax.jit(functools.partial(differentiate, "grad", ref))(args)

    @jax.jit
    def run(seg, pos, args):
        fn = with_tree(context_parallel_attention, seg, pos, anchor, parent, mesh=context_mesh(2))
        return differentiate("value_and_grad", fn, args)

    got = run(seg, pos, args)
    good = jnp.asarray([0, 2])
    assert_close(jax.tree.map(lambda x: x[good], got), jax.tree.map(lambda x: x[good], want))
    assert all(jnp.all(jnp.isnan(x[1])) for x in got[0])
    assert all(jnp.all(g[1] == 0) for g in got[1])
    ids = (jnp.ones((b, 18), jnp.int32), jnp.zeros((b, 18), jnp.int32))
    with pytest.raises(ValueError, match=r"sequence length 18 is not a multiple of 2 \* cp = 4"):
        run(*ids, trunk_and_tree_inputs(rng, b, 18, n))


def mistake(kind):
    """A call with one mistake of `kind`, on one row of 16 tokens and a tree of 3 nodes."""
    q, k = jnp.zeros((1, 16, HQ, D)), jnp.zeros((1, 16, HKV, D))
    seg, pos = jnp.ones((1, 16), jnp.int32), jnp.arange(16)[None]
    tree = dict(q=q[:, :3], k=k[:, :3], v=k[:, :3], anchor=jnp.full((1, 3), 15))
    tree["parent"] = jnp.asarray([[-1, 0, 1]])
    bad = {
        "bool_segment_ids": dict(segment_ids=seg > 0),
        "parent_out_of_range": dict(branch=Branch(**tree | dict(parent=jnp.asarray([[-1, 0, 7]])))),
        "parent_cycle": dict(branch=Branch(**tree | dict(parent=jnp.asarray([[-1, 2, 1]])))),
        "anchor_out_of_range": dict(branch=Branch(**tree | dict(anchor=jnp.full((1, 3), 16)))),
        "tuple_branch": dict(branch=tuple(tree.values())),
        "heads_not_a_multiple": dict(q=jnp.zeros((1, 16, 3, D))),
        "heads_first_layout": dict(q=jnp.swapaxes(q, 1, 2)),
        "no_query_nodes": dict(branch=Branch(**tree | dict(q=q[:, :2]))),
        "impl": dict(impl="cudnn"),
        "tiles_of_another_kernel": dict(impl="pallas_tpu_interpret", tiles=mosaic_gpu.Tiles()),
        "segment_ids_shape": dict(segment_ids=seg[:, :8]),
        "integer_q": dict(q=jnp.zeros((1, 16, HQ, D), jnp.int32)),
        "nonpositive_tile": dict(block_q=-8),
    }[kind]
    return dict(q=q, k=k, v=k, segment_ids=seg, positions=pos) | bad


MISTAKES = {
    "bool_segment_ids": r"segment_ids must be integers \(int32\); got bool",
    "parent_out_of_range": r"branch.parent\[0, 2\] = 7: a parent is the index of an earlier node",
    "parent_cycle": r"branch.parent\[0, 1\] = 2: a parent is the index of an earlier node",
    "anchor_out_of_range": r"branch.anchor\[0, 0\] = 16: an anchor is the index of a trunk key",
    "tuple_branch": r"branch must be a jspec.attention.Branch; got tuple",
    "heads_not_a_multiple": r"Hq a multiple of Hkv=2 \(the heads of k\); got \(1, 16, 3, 8\)",
    "heads_first_layout": r"q \(1, 4, 16, 8\) looks like \[B,H,T,D\].*jnp.swapaxes\(q, 1, 2\)",
    "no_query_nodes": r"branch.q has 2 queries for 3 nodes: pass branch.query_nodes",
    "impl": r"impl='cudnn' is not available",
    "tiles_of_another_kernel": r"not the tiles of the .pallas_tpu_interpret. kernel: pass pallas_t",
    "segment_ids_shape": r"k and v must both be \[B,Tk,Hkv,D\] with \[B,Tk\]=\(1, 8\) from segm",
    "integer_q": r"q must be a floating-point array; got int32",
    "nonpositive_tile": r"block_q=-8 must be a positive tile size",
}


@pytest.mark.parametrize("kind", MISTAKES)
@pytest.mark.parametrize("cp", [1, 2])
def test_mistakes_are_named_in_the_callers_terms(kind, cp):
    """The same message from `attention` and `context_parallel_attention` (global shapes),
    before anything is compiled."""
    call = (
        attention
        if cp == 1
        else functools.partial(context_parallel_attention, mesh=context_mesh(cp))
    )
    with pytest.raises((ValueError, TypeError), match=MISTAKES[kind]):
        call(**mistake(kind))


def test_mesh_none_is_named():
    k = jnp.zeros((1, 16, HKV, D))
    seg, pos = jnp.ones((1, 16), jnp.int32), jnp.arange(16)[None]
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got NoneType"):
        context_parallel_attention(k, k, k, seg, pos, mesh=None)


def test_the_mosaic_kernel_is_refused_where_it_cannot_run():
    """impl='mosaic' off a Hopper GPU, and a head dim or dtype it does not take: named before
    anything is compiled."""
    k = jnp.zeros((1, 16, HKV, 64), jnp.bfloat16)
    seg, pos = jnp.ones((1, 16), jnp.int32), jnp.arange(16)[None]
    with pytest.raises(ValueError, match=r"impl='mosaic' needs a Hopper GPU .*use impl='auto'"):
        attention(k, k, k, seg, pos, impl="mosaic")
    assert not mosaic_gpu.supports(96, jnp.bfloat16) and not mosaic_gpu.supports(128, jnp.float32)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_mosaic_plan_lists_visible_tiles_fully_visible_first(transposed):
    """`mosaic_gpu._plan`, per outer tile (query tiles; key tiles when transposed, as the backward
    walks them): every inner tile holding a visible pair is within the visible count, the tiles
    within the fully visible count are fully visible, and the list is a permutation (the rest is
    never visited)."""
    b, t, bq, bk = 2, 512, 32, 16
    seg, pos = packed_rows(np.random.default_rng(3), b, t, 16)
    see, full = blocks.tile_visibility(seg, pos, seg, pos, bq, bk)
    vis = masks.visible(seg[:, :, None], pos[:, :, None], seg[:, None], pos[:, None])
    tiles = np.asarray(vis).reshape(b, t // bq, bq, t // bk, bk)
    some, every = tiles.any((2, 4)), tiles.all((2, 4))
    if transposed:
        see, full, some, every = (jnp.swapaxes(x, 1, 2) for x in (see, full, some, every))
    plan = np.asarray(mosaic_gpu._plan(see, full))
    some, every = np.asarray(some), np.asarray(every)
    for r in range(b):
        for i in range(plan.shape[1]):
            n_full, n, order = plan[r, i, 0], plan[r, i, 1], plan[r, i, 2:]
            assert sorted(order) == list(range(len(order)))
            assert set(np.flatnonzero(some[r, i])) <= set(order[:n])
            assert every[r, i, order[:n_full]].all()
    assert plan[..., 0].sum() > 0 and (plan[..., 1] > plan[..., 0]).any()  # both kinds occur


def test_readme_example_runs():
    """The README's "Using jspec.attention" example runs as written (8 devices: conftest)."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = readme.split("## Using jspec.attention")[1].split("```python\n")[1].split("```")[0]
    exec(compile(code, "README.md", "exec"), {})


# ---------------------------------------------------------------------------------------------
# Work balance and memory of the ring.


def executed_tiles_per_rank(seg, pos, cp, block, layout):
    """Tile pairs each rank computes over the ring (the kernel's own skip rule, `may_see`)."""
    t = seg.shape[1]
    if layout == "zigzag":
        seg, pos = zigzag_shard(seg, seg, cp), zigzag_shard(pos, seg, cp)
    shards = [
        (seg[:, r * t // cp : (r + 1) * t // cp], pos[:, r * t // cp : (r + 1) * t // cp])
        for r in range(cp)
    ]
    ranges = [blocks.tile_ranges(s, p, block) for s, p in shards]
    counts = []
    for qr in ranges:
        n = 0
        for kr in ranges:
            n += int(
                jnp.sum(
                    blocks.may_see(
                        jax.tree.map(lambda x: x[:, None], qr),
                        jax.tree.map(lambda x: x[None, :], kr),
                    )
                )
            )
        counts.append(n)
    return np.asarray(counts)


def test_zigzag_balances_executed_tiles():
    rng = np.random.default_rng(11)
    cp, t, block = 4, 8192, 16
    seg, pos = packed_rows(rng, 1, t, 2 * cp * block)
    zz = executed_tiles_per_rank(seg, pos, cp, block, "zigzag")
    assert zz.max() / zz.min() - 1 < 0.05, zz
    contiguous = executed_tiles_per_rank(seg, pos, cp, block, "contiguous")
    assert contiguous.max() > 1.05 * contiguous.min(), contiguous  # the test can tell


def _ring_fwd_bwd(cp, t, block, layers=1):
    """The compiled per-device fwd+bwd of ring_attention over a ring of cp devices; with layers
    > 1, of a scan over that many layers, each layer's output the next one's queries."""
    mesh = jax.make_mesh(
        (cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:cp]
    )
    spec = P(None, "context")

    def loss(q, k, v, seg, pos):
        def local(q, k, v, seg, pos):
            def layer(x, _):
                out = ring_attention(
                    x, k, v, seg, pos, axis_name="context", block_q=block, block_k=block
                )
                return out, None

            out = jax.lax.scan(layer, q, None, length=layers)[0] if layers > 1 else layer(q, 0)[0]
            return jnp.sum(out.astype(jnp.float32) ** 2)[None]

        return jax.shard_map(
            local, mesh=mesh, in_specs=(spec,) * 5, out_specs=P("context"), check_vma=False
        )(q, k, v, seg, pos).sum()

    shape = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(  # noqa: E731
        s, dt, sharding=jax.sharding.NamedSharding(mesh, spec)
    )
    args = (
        shape(1, t, HQ, 32),
        shape(1, t, HKV, 32),
        shape(1, t, HKV, 32),
        shape(1, t, dt=jnp.int32),
        shape(1, t, dt=jnp.int32),
    )
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def _largest_buffer(compiled):
    """Bytes of the largest array shape in the per-device optimised HLO."""
    import re

    sizes = {"f32": 4, "s32": 4, "bf16": 2, "pred": 1, "u32": 4, "f16": 2, "s8": 1, "u8": 1}
    best = 0
    for dtype, dims in re.findall(
        r"\b(f32|s32|bf16|pred|u32|f16|s8|u8)\[([\d,]*)\]", compiled.as_text()
    ):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        best = max(best, n * sizes[dtype])
    return best


@pytest.mark.slow
def test_ring_memory_scales_with_cp():
    t, block = 8192, 64
    temps = {}
    for cp in (2, 4, 8):
        compiled = _ring_fwd_bwd(cp, t, block)
        q_shard = (t // cp) * HQ * 32 * 4  # the rank's queries in float32
        score_tile = HQ * block * block * 4
        assert _largest_buffer(compiled) <= max(2 * q_shard, score_tile), (
            cp,
            _largest_buffer(compiled),
            q_shard,
        )
        temps[cp] = compiled.memory_analysis().temp_size_in_bytes
    # About 1/cp: each doubling of cp at least 1.6x less temporary memory.
    assert temps[2] / temps[4] > 1.6 and temps[4] / temps[8] > 1.6, temps


def test_ring_in_a_layer_scan_keeps_no_buffer_of_all_tiles():
    """Under `grad` of a scan over layers, JAX hoists what depends only on loop-invariant inputs
    out of the loop; the tile masks (a function of the ids alone) once went, the mask and score
    tiles of every tile pair then existing at once. The largest buffer stays a few query shards."""
    t, block = 2048, 64
    compiled = _ring_fwd_bwd(2, t, block, layers=2)
    q_shard = (t // 2) * HQ * 32 * 4
    assert _largest_buffer(compiled) <= 2 * q_shard, (_largest_buffer(compiled), q_shard)


def test_check_alignment_accepts_aligned_rows():
    seg = jnp.asarray([[1] * 8 + [2] * 4 + [0] * 4])
    zigzag.check_alignment(seg, 2)


def test_decode_splits_merge_alike_by_steps_and_by_reductions():
    """The decode kernel's splits merge by elementwise steps (up to `_UNROLLED_SPLITS`) or by
    reductions over the axis (more): 40 splits at once (reductions) equal two halves merged by
    steps, then merged again; splits and whole rows that saw nothing (m = -inf, l = acc = 0)
    included."""
    rng = np.random.default_rng(13)
    b, k, n, r, d = 2, 3, 40, 4, 8
    assert n > pallas_decode._UNROLLED_SPLITS >= n // 2
    m = jnp.asarray(rng.normal(size=(b, k, n, r)), jnp.float32)
    unseen = jnp.asarray(rng.random((b, k, n, r)) < 0.3).at[0, 0, :, 0].set(True)
    m = jnp.where(unseen, -jnp.inf, m)
    l = jnp.where(unseen, 0.0, jnp.asarray(rng.random((b, k, n, r)) + 0.5, jnp.float32))
    acc = jnp.where(unseen[..., None], 0.0, normal(rng, b, k, n, r, d))
    halves = [pallas_decode._merge_splits(*(x[:, :, i : i + n // 2] for x in (m, l, acc)))
              for i in (0, n // 2)]  # fmt: skip
    stacked = (jnp.stack(parts, axis=2) for parts in zip(*halves, strict=True))
    got, want = pallas_decode._merge_splits(m, l, acc), pallas_decode._merge_splits(*stacked)
    for g, w in zip(got, want, strict=True):  # -inf where equal: no relative error of it
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_pallas_tpu_decode_kernel_folds_only_filled_blocks():
    """The TPU kernel (interpreted) over caches of several of its 128-slot blocks, rows filled to
    different depths (the blocks past a row's last filled slot are skipped), and a tree: the state
    of the XLA path, which reads every slot."""
    rng = np.random.default_rng(12)
    b, s, n = 3, 3 * pallas_tpu_decode.BLOCK_K, 5
    seg, pos = packed_rows(rng, b, s, 4)
    seg = seg * (jnp.arange(s) < jnp.array([[40], [200], [s]]))  # 1, 2 and 3 filled blocks
    k, v = normal(rng, b, HKV, s, D), normal(rng, b, HKV, s, D)
    qg = normal(rng, b, 2, HKV, HQ // HKV, D)
    q_seg, q_pos = seg[:, :2], jnp.full((b, 2), s, jnp.int32)
    bk, bv = normal(rng, b, HKV, n, D), normal(rng, b, HKV, n, D)
    seen = jnp.asarray(rng.random((b, 2, n)) < 0.6)
    args = (qg, q_seg, q_pos, k, v, seg, pos, (bk, bv, seen))
    got = pallas_tpu_decode.kernel_state(*args, scale=D**-0.5, interpret=True)
    want = decode.xla_state(*args, scale=D**-0.5)
    assert_close(got, want)


@pytest.mark.parametrize("dtype, batch, queries", [(jnp.bfloat16, 4, 5), (jnp.float32, 1, 40)])
def test_pallas_decode_kernel_lowers_to_triton(dtype, batch, queries):
    """The kernel GPUs run for impl='decode' (the cache and a tree of `queries` nodes) lowers to
    Triton for CUDA, here on the CPU (export lowers for a platform it does not run on), so a kernel
    Triton cannot take fails in CI. The GPU it lowers for is named by an abstract device (jax 0.11
    asks the device for its kind)."""
    hq, hkv, d, s = 32, 8, 128, 576
    sds = jax.ShapeDtypeStruct
    ids = lambda n: sds((batch, n), jnp.int32)
    kv = lambda n: sds((batch, n, hkv, d), dtype)
    cache = sds((batch, hkv, s, d), dtype)
    q = sds((batch, queries, hq, d), dtype)
    tree = (ids(queries), kv(queries), kv(queries), ids(queries))  # nodes, keys, values, parents
    args = (q, ids(queries), ids(queries), cache, cache, ids(s), ids(s), *tree)
    options = decode.DecodeOptions(backend="pallas")
    attend = lambda *a: decode.decode_attention(*a, scale=d**-0.5, options=options)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(attend), platforms=["cuda"], disabled_checks=[triton])
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h200)):
        assert "jspec_decode_trunk" in exported(*args).mlir_module()
