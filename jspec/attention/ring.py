"""Attention over trunk keys that travel a ring of devices, plus local branch keys; one custom_vjp.

Each rank holds its queries (trunk queries, then branch queries, as one array), its trunk K/V and
its branch K/V. Branch K/V never leave the rank: the branch queries see them first, by the ancestor
walk. Then the trunk K/V visit every rank by `ppermute` over the context axis, and at each step the
block kernel continues the rank's running output and log-sum-exp with the visiting keys (hidden
tiles skipped): the exact log-sum-exp merge happens inside the kernel, in place, in float32. On one
device (no axis) the ring has one step: that is `attention`.

The backward runs the ring again: K/V travel with their gradient accumulators (float32), which are
back home after the last shift; each block's backward is given the global lse, so nothing but the
inputs, the output and the lse is saved, and no rank ever holds more than its own share of K/V.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, checks, decode, masks, pallas_gpu
from jspec.attention.branch import Branch

BLOCK_Q = 512
BLOCK_K = 512
PALLAS_PAD = 128  # a multiple of every Pallas tile, so the kernel never pads per ring step
# The block kernel: "xla" (portable), "pallas" (NVIDIA GPU), "pallas_interpret" (the Pallas kernel
# in Pallas' interpreter on any backend: slow, for tests); "auto" takes "pallas" where it runs.
# "decode": few queries per row against a long cache, on one device (`decode.py`: rollouts).
IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "decode")


class _Static(NamedTuple):
    kernel: str  # "xla", "pallas" or "pallas_interpret"
    axis_name: str | None
    scale: float
    block_q: int
    block_k: int
    branch_rows: tuple[int, int]  # [start, stop) of the branch queries in the query array
    tiles: pallas_gpu.Tiles | None  # the Pallas kernel's (None: `pallas_gpu.default_tiles`)


def _kernel(st: _Static):
    """The block forward and backward of the chosen kernel (same signatures)."""
    if st.kernel == "xla":
        return blocks.fwd, blocks.bwd
    kw = dict(interpret=st.kernel == "pallas_interpret", tiles=st.tiles)
    return functools.partial(pallas_gpu.fwd, **kw), functools.partial(pallas_gpu.bwd, **kw)


def _resolve(impl: str, head_dim: int) -> str:
    if impl == "auto":
        return "pallas" if pallas_gpu.available() and pallas_gpu.supports(head_dim) else "xla"
    if impl == "pallas" and not pallas_gpu.available():
        raise ValueError(
            "impl='pallas' needs an NVIDIA GPU with Pallas' Triton backend; use impl='auto' or "
            "'xla' here (or 'pallas_interpret' to run the kernel in the interpreter)."
        )
    if impl.startswith("pallas") and not pallas_gpu.supports(head_dim):
        raise ValueError(
            f"impl={impl!r} needs a head dim that is a power of two >= 16, got {head_dim}; "
            "use impl='xla'."
        )
    return impl


def _ring_size(axis_name):
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def _varying(x, axis_name):
    """x typed as varying over the ring axis (shard_map's check_vma): every value the ring's loops
    combine then carries one type, and the gradient of a replicated input is summed over the ring.
    A no-op off a ring, where x already varies, or where check_vma is off."""
    if x is None or axis_name is None or axis_name in jax.typeof(x).mat.varying:
        return x
    return jax.lax.pcast(x, axis_name, to="varying")


def _shift(xs, axis_name):
    """Send to the next rank of the ring, receive from the previous one (identity off a ring)."""
    n = _ring_size(axis_name)
    if n == 1:
        return xs
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), xs)


def _with_rows(x, rows: slice, y):
    """x with rows [start, stop) of axis 1 replaced by y (by concatenation: an in-place update
    covering the whole array crashed XLA's CPU compiler in jax 0.11.2 inside shard_map)."""
    return jnp.concatenate([x[:, : rows.start], y, x[:, rows.stop :]], axis=1)


def _tied(q, *ids):
    """q and the segment ids and positions, the ids made to depend on q.

    Under `jax.grad` of a `lax.scan` over layers, JAX hoists whatever depends only on the scan's
    loop-invariant inputs out of the loop, and the tile masks depend only on the ids, the same in
    every layer: hoisted, the mask of every tile pair of every ring step exists at once (quadratic
    in the tokens). Tied to q by an optimization barrier, they are computed tile by tile again.
    """
    return jax.lax.optimization_barrier((q, *ids))


def _forward(st: _Static, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    """(o, lse) in float32. One accumulator, filled first by the local branch-to-branch part,
    then by every ring step in place: no partial result is ever held beside it."""
    q, q_seg, q_pos, k_seg, k_pos = _tied(q, q_seg, q_pos, k_seg, k_pos)
    tiles = dict(scale=st.scale, block_q=st.block_q, block_k=st.block_k)
    o = jnp.zeros_like(q, jnp.float32)
    lse = jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)
    if bk is not None:
        rows = slice(*st.branch_rows)
        ob, lseb = blocks.branch_fwd(q[:, rows], bk, bv, b_nodes, b_parent, scale=st.scale)
        o, lse = _with_rows(o, rows, ob), _with_rows(lse, rows, lseb)

    def step(carry, _):
        acc, kv = carry
        # The shift does not depend on this step's compute, so the two overlap. Every step
        # shifts, the last one uselessly (its transfer hides under the compute): one uniform scan
        # body lets every buffer be reused, where a last step outside the loop costs memory.
        kv_next = _shift(kv, st.axis_name)
        acc = _kernel(st)[0](q, kv[0], kv[1], q_seg, q_pos, kv[2], kv[3], acc, **tiles)
        return (acc, kv_next), None

    ((o, lse), _), _ = jax.lax.scan(
        step, ((o, lse), (k, v, k_seg, k_pos)), length=_ring_size(st.axis_name)
    )
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Static, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    o, _ = _forward(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent)
    return o.astype(q.dtype)


def _ring_fwd(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    o, lse = _forward(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent)
    o = o.astype(q.dtype)
    return o, (q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent, o, lse)


def _ring_bwd(st, res, do):
    q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent, o, lse = res
    q, q_seg, q_pos, k_seg, k_pos = _tied(q, q_seg, q_pos, k_seg, k_pos)
    tiles = dict(scale=st.scale, block_q=st.block_q, block_k=st.block_k)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)

    dq = jnp.zeros_like(q, jnp.float32)
    dbk = dbv = None
    if bk is not None:
        rows = slice(*st.branch_rows)
        q_b, lse_b, do_b, delta_b = (x[:, rows] for x in (q, lse, do, delta))
        dqb, dbk, dbv = blocks.branch_bwd(
            q_b, bk, bv, b_nodes, b_parent, lse_b, do_b, delta_b, scale=st.scale
        )
        dq = _with_rows(dq, rows, dqb)
        dbk, dbv = dbk.astype(bk.dtype), dbv.astype(bv.dtype)

    def step(carry, _):
        dq, kv, dkv = carry
        kv_next = _shift(kv, st.axis_name)  # as in the forward: every step, for one scan body
        dq, dk_s, dv_s = _kernel(st)[1](
            q, kv[0], kv[1], q_seg, q_pos, kv[2], kv[3], lse, do, delta, dq, **tiles
        )
        # The accumulators travel with their keys: after cp shifts they are home again.
        dkv = _shift((dkv[0] + dk_s, dkv[1] + dv_s), st.axis_name)
        return (dq, kv_next, dkv), None

    init = (dq, (k, v, k_seg, k_pos), (jnp.zeros_like(k, jnp.float32),) * 2)
    (dq, _, (dk, dv)), _ = jax.lax.scan(step, init, length=_ring_size(st.axis_name))
    return (
        dq.astype(q.dtype),
        None,
        None,
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        None,
        dbk,
        dbv,
        None,
        None,
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------
# The public entry points: checks, the query array, padding to whole tiles.


def _attend(
    q,
    k,
    v,
    segment_ids,
    positions,
    *,
    axis_name,
    q_segment_ids,
    q_positions,
    branch,
    scale,
    impl,
    block_q,
    block_k,
    tiles=None,
    decode_options=None,
    heads_major=False,
):
    if heads_major:  # [B,Hkv,Tk,D]: checked as the [B,Tk,Hkv,D] it stands for
        as_bthd = lambda x: jax.ShapeDtypeStruct(jnp.swapaxes(x, 1, 2).shape, x.dtype)
        checked_kv = (as_bthd(k), as_bthd(v))
    else:
        checked_kv = (k, v)
    checks.check_inputs(
        q, *checked_kv, segment_ids, positions, q_segment_ids, q_positions, branch, impl, IMPLS
    )
    scale = float(k.shape[-1] ** -0.5 if scale is None else scale)
    if q_segment_ids is None:
        q_segment_ids, q_positions = segment_ids, positions

    parts = [] if q is None else [(q, q_segment_ids, q_positions)]
    b_nodes = None
    if branch is not None:
        nodes = branch.nodes()
        node_anchor = blocks.gather_rows(branch.anchor, nodes)
        live = (nodes >= 0) & (node_anchor >= 0)
        b_nodes = jnp.where(live, nodes, -1)
        seg, pos = masks.anchor_segments(segment_ids, positions, jnp.where(live, node_anchor, -1))
        parts.append((branch.q.astype(q.dtype) if q is not None else branch.q, seg, pos))
    n_trunk = 0 if q is None else q.shape[1]
    n_rows = sum(p[0].shape[1] for p in parts)
    bk, bv, parent = (None, None, None) if branch is None else (branch.k, branch.v, branch.parent)
    if impl == "decode":
        if axis_name is not None:
            raise ValueError("impl='decode' runs on one device; use impl='auto' in the ring.")
        q_all, q_seg, q_pos = (jnp.concatenate(xs, axis=1) for xs in zip(*parts, strict=True))
        nodes = None
        if branch is not None:
            trunk_rows = jnp.full((k.shape[0], n_trunk), -1, jnp.int32)
            nodes = jnp.concatenate([trunk_rows, b_nodes], axis=1)
        if not heads_major:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        args = (q_all, q_seg, q_pos, k, v, segment_ids, positions, nodes, bk, bv, parent)
        out = decode.decode_attention(*args, scale=scale, options=decode_options)
        out = out.astype(q_all.dtype)
        return _split_rows(out, q, branch, n_trunk, n_rows)
    if heads_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

    kernel = _resolve(impl, k.shape[-1])
    if kernel == "xla":
        block_q = min(block_q or BLOCK_Q, blocks.round_up(n_rows, 8))
        block_k = min(block_k or BLOCK_K, blocks.round_up(k.shape[1], 8))
    else:  # the kernel tiles by its own sizes; pad to a multiple of them here, once
        block_q = block_k = PALLAS_PAD
    rows = blocks.round_up(n_rows, block_q)
    keys = blocks.round_up(k.shape[1], block_k)
    q_all, q_seg, q_pos = (
        blocks.pad_rows(jnp.concatenate(xs, axis=1), rows) for xs in zip(*parts, strict=True)
    )
    k_all, v_all, k_seg, k_pos = (blocks.pad_rows(x, keys) for x in (k, v, segment_ids, positions))

    st = _Static(kernel, axis_name, scale, block_q, block_k, (n_trunk, n_rows), tiles)
    args = (q_all, q_seg, q_pos, k_all, v_all, k_seg, k_pos, bk, bv, b_nodes, parent)
    out = _ring(st, *(_varying(x, axis_name) for x in args))
    return _split_rows(out, q, branch, n_trunk, n_rows)


def _split_rows(out, q, branch, n_trunk: int, n_rows: int):
    """The trunk output, or (trunk, branch) outputs, of the concatenated query rows."""
    trunk_out = None if q is None else out[:, :n_trunk]
    if branch is None:
        return trunk_out
    return trunk_out, out[:, n_trunk:n_rows].astype(branch.q.dtype)


def attention(
    q: Float[Array, "b tq hq d"] | None,
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    segment_ids: Int[Array, "b tk"],
    positions: Int[Array, "b tk"],
    *,
    q_segment_ids: Int[Array, "b tq"] | None = None,
    q_positions: Int[Array, "b tq"] | None = None,
    branch: Branch | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: pallas_gpu.Tiles | None = None,
    decode_options: decode.DecodeOptions | None = None,
    heads_major: bool = False,
):
    """Masked attention on one device, blockwise (no score tile beyond a block), differentiable.

    Returns the trunk output [B,Tq,Hq,D] (None when q is None), or `(out, branch_out)` with a
    branch. `block_q`, `block_k` set the tile of the XLA blocks (default 512 x 512, clipped to the
    lengths), `tiles` those of the Pallas kernel (None: `pallas_gpu.default_tiles` of the dtype),
    `decode_options` how `impl="decode"` runs (None: `decode.DecodeOptions()`). Visibility is the
    contract's (docs/attention.md); `reference.py` is its dense statement. `heads_major`: k and v
    are [B,Hkv,Tk,D], a KV cache's layout, which `impl="decode"` reads as it is (the other paths
    transpose it).
    """
    return _attend(
        q,
        k,
        v,
        segment_ids,
        positions,
        axis_name=None,
        q_segment_ids=q_segment_ids,
        q_positions=q_positions,
        branch=branch,
        scale=scale,
        impl=impl,
        block_q=block_q,
        block_k=block_k,
        tiles=tiles,
        decode_options=decode_options,
        heads_major=heads_major,
    )


def ring_attention(
    q: Float[Array, "b tq hq d"] | None,
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    segment_ids: Int[Array, "b tk"],
    positions: Int[Array, "b tk"],
    *,
    axis_name: str,
    q_segment_ids: Int[Array, "b tq"] | None = None,
    q_positions: Int[Array, "b tq"] | None = None,
    branch: Branch | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: pallas_gpu.Tiles | None = None,
):
    """`attention` inside `shard_map`, the trunk K/V spread over the ring axis `axis_name`.

    Every array is the rank's local shard (trunk in zigzag order, `zigzag_shard`); branch indices
    (anchor, parent, query_nodes) are local to the rank, and a node's ancestors live on its rank.
    """
    return _attend(
        q,
        k,
        v,
        segment_ids,
        positions,
        axis_name=axis_name,
        q_segment_ids=q_segment_ids,
        q_positions=q_positions,
        branch=branch,
        scale=scale,
        impl=impl,
        block_q=block_q,
        block_k=block_k,
        tiles=tiles,
    )
