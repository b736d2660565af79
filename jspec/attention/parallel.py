"""Context parallelism for natural-order global arrays: zigzag, place the branch, ring, undo.

`context_parallel_attention` is `attention` with the same inputs and outputs, computed by
`ring_attention` over the mesh axis `axis`. Trunk rows are permuted to the zigzag layout and split
over the axis; each branch node (and query) moves to the rank that holds its anchor, into a
fixed number of slots per rank.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from jspec.attention import checks, explicit, pallas_gpu, zigzag
from jspec.attention.attend import IMPLS, ring_attention
from jspec.attention.branch import Branch


def _slots(rank, cp: int, capacity: int):
    """Slot (rank * capacity + order among the items of that rank) of each item [B, N]."""
    onehot = jax.nn.one_hot(rank, cp, dtype=jnp.int32)
    order = jnp.take_along_axis(jnp.cumsum(onehot, axis=1), rank[..., None], axis=2)[..., 0] - 1
    return rank * capacity + order


def _capacity(rank, cp: int, fallback: int) -> int:
    """Items per rank: exact for concrete inputs (rounded up to 8), else the worst case."""
    if not zigzag.concrete(rank):
        return fallback
    counts = np.stack([(np.asarray(rank) == r).sum(axis=1) for r in range(cp)])
    return max(8, -(-int(counts.max()) // 8) * 8)


def _scatter(x, slot, size, fill):
    b = x.shape[0]
    out = jnp.full((b, size) + x.shape[2:], fill, x.dtype)
    return out.at[jnp.arange(b)[:, None], slot].set(x)


def place_branch(branch: Branch, segment_ids: Int[Array, "b t"], cp: int):
    """Moves nodes and queries to the rank of their anchor, into a fixed number of slots per rank.

    Returns the branch in the sharded layout (rank-major slots, rank-local indices) and the slot of
    each natural-order query, to read the outputs back. Slots per rank: the exact maximum for
    concrete anchors, all N nodes under `jit` (the worst case: a tree anchored on one rank). A
    caller that already holds its branch per rank (draft co-training) uses `ring_attention`.
    """
    t = segment_ids.shape[1]
    dest = zigzag.zigzag_destination(segment_ids, t, cp)
    n = branch.anchor.shape[1]
    nodes = branch.nodes()
    live = branch.anchor >= 0
    anchor_dest = jnp.take_along_axis(dest, jnp.maximum(branch.anchor, 0), axis=1)
    node_rank = jnp.where(live, anchor_dest // (t // cp), 0)
    if zigzag.concrete(branch.parent, node_rank):
        parent = np.asarray(branch.parent)
        nr = np.asarray(node_rank)
        has_parent = parent >= 0
        parent_rank = np.take_along_axis(nr, np.maximum(parent, 0), axis=1)
        bad = np.argwhere(has_parent & np.asarray(live) & (parent_rank != nr))
        if len(bad):
            row, node = bad[0]
            raise ValueError(
                f"branch node {node} of row {row} and its parent {parent[row, node]} are anchored "
                "on different context ranks; a node and its ancestors must share the anchor's "
                "rank (anchor a node's whole path at one trunk token)."
            )
    cap = _capacity(node_rank, cp, n)
    node_slot = _slots(node_rank, cp, cap)
    parent_slot = jnp.take_along_axis(node_slot, jnp.maximum(branch.parent, 0), axis=1) % cap
    local_anchor = jnp.where(live, anchor_dest % (t // cp), -1)
    query_rank = jnp.take_along_axis(node_rank, nodes, axis=1)
    qcap = _capacity(query_rank, cp, nodes.shape[1])
    query_slot = _slots(query_rank, cp, qcap)
    placed = Branch(
        q=_scatter(branch.q, query_slot, cp * qcap, 0),
        k=_scatter(branch.k, node_slot, cp * cap, 0),
        v=_scatter(branch.v, node_slot, cp * cap, 0),
        anchor=_scatter(local_anchor, node_slot, cp * cap, -1),
        parent=_scatter(jnp.where(branch.parent >= 0, parent_slot, -1), node_slot, cp * cap, -1),
        # An empty query slot points at no node (-1) and sees nothing.
        query_nodes=_scatter(
            jnp.take_along_axis(node_slot, nodes, axis=1) % cap, query_slot, cp * qcap, -1
        ),
    )
    return placed, query_slot


def context_parallel_attention(
    q: Float[Array, "b t hq d"] | None,
    k: Float[Array, "b t hkv d"],
    v: Float[Array, "b t hkv d"],
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    *,
    mesh: Mesh,
    axis: str = "context",
    branch: Branch | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: pallas_gpu.Tiles | None = None,
):
    """Self-attention (plus branch) of natural-order rows, context-parallel over `mesh[axis]`.

    Every index (anchor, parent, query_nodes) is a natural-order index of the row; every document
    must be padded to a multiple of 2 * cp: a clear error for concrete ids; under `jit` the
    outputs of a row holding a misaligned document are NaN, and the other rows are exact. Same
    results as `attention`, wherever inputs live (`tiles`: the Pallas kernel's, as there).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh with an axis {axis!r} to spread the rows over; got "
            f"{type(mesh).__name__}. For example jax.make_mesh((cp,), ({axis!r},)); on one "
            "device call jspec.attention.attention instead."
        )
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}.")
    cp = mesh.shape[axis]
    checks.check_inputs(q, k, v, segment_ids, positions, None, None, branch, impl, IMPLS)
    zigzag.check_alignment(segment_ids, cp)
    mesh = explicit.auto_mesh(mesh)
    ring = sharded_ring(mesh, axis, scale, impl, block_q, block_k, tiles=tiles)

    def run(q, k, v, segment_ids, positions, branch):
        placed = query_slot = None
        if branch is not None:
            placed, query_slot = place_branch(branch, segment_ids, cp)
        return _run(ring, mesh, axis, q, k, v, segment_ids, positions, placed, query_slot)

    args = (q, k, v, segment_ids, positions, branch)
    out, branch_out = explicit.run_auto(run, args, like=(q, None if branch is None else branch.q))
    return out if branch is None else (out, branch_out)


@functools.lru_cache(maxsize=64)
def sharded_ring(
    mesh: Mesh,
    axis: str,
    scale=None,
    impl="auto",
    block_q=None,
    block_k=None,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    tiles: pallas_gpu.Tiles | None = None,
):
    """`ring_attention` under `shard_map` over `axis`: f(q, k, v, seg, pos, branch) -> (out, b_out).

    Takes global arrays already in the zigzag layout (`zigzag_shard`, `place_branch`), row axis
    split over `axis` (and batch over `batch_axis`, heads over `head_axis`, if given); returns the
    outputs in the same layout (None where q or branch is None).
    """
    rows = PartitionSpec(batch_axis, axis)
    heads = PartitionSpec(batch_axis, axis, head_axis)

    def spec(x):  # [B, T, H, D] arrays split their heads too; [B, T] ones do not
        return heads if x.ndim == 4 else rows

    kernel = dict(scale=scale, impl=impl, block_q=block_q, block_k=block_k, tiles=tiles)

    def local(q, k, v, seg, pos, branch):
        out = ring_attention(q, k, v, seg, pos, axis_name=axis, branch=branch, **kernel)
        return out if branch is not None else (out, None)

    def ring(q, k, v, seg, pos, branch):
        args = (q, k, v, seg, pos, branch)
        in_specs = jax.tree.map(spec, args)
        if mesh.shape[axis] == 1 and not _divides(mesh, args, in_specs):
            # One ring step, and rows or heads that do not split evenly: left where XLA puts them.
            out = ring_attention(q, k, v, seg, pos, axis_name=None, branch=branch, **kernel)
            return out if branch is not None else (out, None)
        out_specs = (None if q is None else heads, None if branch is None else heads)
        sharded = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return sharded(*args)

    return ring


def _divides(mesh: Mesh, args, specs) -> bool:
    """Whether every axis of every array splits evenly over the mesh axes its spec names."""
    names = lambda name: (name,) if isinstance(name, str) else name or ()
    size = lambda name: math.prod(mesh.shape[n] for n in names(name))
    pairs = zip(
        jax.tree.leaves(args),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
        strict=True,
    )
    return all(
        n % size(name) == 0 for x, spec in pairs for n, name in zip(x.shape, spec, strict=False)
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run(ring, mesh, axis, q, k, v, seg, pos, branch, query_slot):
    """Zigzag, ring, undo; `mesh` has Auto axes, so placement is left to the compiler."""
    cp = mesh.shape[axis]
    split = NamedSharding(mesh, PartitionSpec(None, axis))

    def shard(x):
        if x is None:
            return None
        return jax.lax.with_sharding_constraint(zigzag.zigzag_shard(x, seg, cp), split)

    branch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, split), branch)
    out, branch_out = ring(shard(q), shard(k), shard(v), shard(seg), shard(pos), branch)
    if out is not None:
        out = zigzag.mark_misaligned(zigzag.zigzag_unshard(out, seg, cp), seg, cp)
    if branch_out is not None:
        rows = jnp.arange(branch_out.shape[0])[:, None]
        branch_out = zigzag.mark_misaligned(branch_out[rows, query_slot], seg, cp)
    return out, branch_out
