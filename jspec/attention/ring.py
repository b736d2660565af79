"""Attention over trunk keys that travel a ring of devices, plus local branch keys; one custom_vjp.

Each rank holds its queries (trunk queries, then branch queries, as one array), its trunk K/V and
its branch K/V. Branch K/V never leave the rank: the branch queries see them first, by the ancestor
walk. Then the trunk K/V visit every rank by `ppermute` over the context axis, and at each step the
block kernel continues the rank's running output and log-sum-exp with the visiting keys (hidden
tiles skipped): the exact log-sum-exp merge happens inside the kernel, in place, in float32. On one
device (no axis) the ring has one step. `attend.py` turns the contract's arguments into the ring's.

The backward runs the ring again: K/V travel with their gradient accumulators (float32), which are
back home after the last shift; each block's backward is given the global lse, so nothing but the
inputs, the output and the lse is saved, and no rank ever holds more than its own share of K/V.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jspec.attention import blocks, mosaic_gpu, pallas_gpu, pallas_tpu

# The checkpoint name of attention's output and log-sum-exp, all its backward needs beside q, k, v:
# a remat policy that saves them (`jax.checkpoint_policies.save_only_these_names`) keeps the
# backward from running the forward kernel again.
SAVED = "attention"


class Static(NamedTuple):
    kernel: (
        str  # "xla", "xla_or_tpu", "pallas", "mosaic", "pallas_tpu", or a Pallas one + "_interpret"
    )
    axis_name: str | None
    scale: float
    block_q: int
    block_k: int
    branch_rows: tuple[int, int]  # [start, stop) of the branch queries in the query array
    tiles: (
        pallas_gpu.Tiles | mosaic_gpu.Tiles | pallas_tpu.Tiles | None
    )  # the kernel's (None: default)


def _kernel(st: Static):
    """The block forward and backward of the chosen kernel (same signatures)."""
    if st.kernel == "xla":
        return blocks.fwd, blocks.bwd
    if st.kernel == "xla_or_tpu":
        return _xla_or_tpu(blocks.fwd, pallas_tpu.fwd), _xla_or_tpu(blocks.bwd, pallas_tpu.bwd)
    if st.kernel == "mosaic":
        return tuple(functools.partial(f, tiles=st.tiles) for f in (mosaic_gpu.fwd, mosaic_gpu.bwd))
    module = pallas_tpu if st.kernel.startswith("pallas_tpu") else pallas_gpu
    kw = dict(interpret=st.kernel.endswith("_interpret"), tiles=st.tiles)
    return functools.partial(module.fwd, **kw), functools.partial(module.bwd, **kw)


def _xla_or_tpu(xla, tpu):
    """`xla`, or `tpu` (its default tiles) in a program compiled for a TPU: the choice is made when
    lowering, so a CPU host that compiles for a TPU slice ahead of time gets the TPU kernel."""

    def call(*args, scale, **blocks_kw):
        on_tpu = lambda *a: tpu(*a, scale=scale)
        on_xla = lambda *a: xla(*a, scale=scale, **blocks_kw)
        return jax.lax.platform_dependent(*args, tpu=on_tpu, default=on_xla)

    return call


def _ring_size(axis_name):
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def varying(x, axis_name):
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


def _forward(st: Static, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    """(o, lse) in float32 (o in q's dtype from a Mosaic forward with nothing to continue). One
    accumulator, filled first by the local branch-to-branch part, then by every ring step in
    place: no partial result is ever held beside it."""
    q, q_seg, q_pos, k_seg, k_pos = _tied(q, q_seg, q_pos, k_seg, k_pos)
    tiles = dict(scale=st.scale, block_q=st.block_q, block_k=st.block_k)
    if st.kernel == "mosaic" and bk is None and _ring_size(st.axis_name) == 1:
        # Nothing to continue: the kernel writes o in q's dtype at once, the only one kept of it.
        fwd = functools.partial(_kernel(st)[0], out_dtype=q.dtype)
        return fwd(q, k, v, q_seg, q_pos, k_seg, k_pos, None, **tiles)
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
def run(st: Static, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    o, _ = _forward(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent)
    return o.astype(q.dtype)


def _run_fwd(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent):
    o, lse = _forward(st, q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent)
    # Named, so that a remat policy may keep them (SAVED) rather than run the forward again.
    o, lse = (checkpoint_name(x, SAVED) for x in (o.astype(q.dtype), lse))
    return o, (q, q_seg, q_pos, k, v, k_seg, k_pos, bk, bv, b_nodes, b_parent, o, lse)


def _run_bwd(st, res, do):
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


run.defvjp(_run_fwd, _run_bwd)


# ---------------------------------------------------------------------------------------------
# The public entry points: checks, the query array, padding to whole tiles.
