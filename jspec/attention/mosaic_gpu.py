"""The block kernel on Hopper GPUs through Pallas' Mosaic GPU backend: `blocks.fwd` / `blocks.bwd`
with TMA copies, wgmma products and warp specialisation (FlashAttention-3's layout).

Same signatures and results as `pallas_gpu` (Triton), whose backend JAX 0.11 deprecates, and
which tops out near 0.7x of cuDNN on an H100/H200: Triton cannot give one warp group the copies
while two others multiply.

A program has three warp groups: two compute, each owning 64 rows of the program's tile, and one
that only copies, streaming tiles into a ring of `steps` shared-memory slots. Per slot, barriers
say "landed" (the copy's bytes arrived) and "consumed" (both compute groups are done with it).

- forward: a program per (query head, 128-query tile, row) streams K/V tiles; online softmax in
  base 2; the running (o, lse) is continued in place (`jax.new_ref`), as the ring needs, and
  with none to continue (no ring, no tree) the kernel writes outputs of its own, o in the dtype
  asked for, where an empty running output would be written in float32 by XLA, read back by
  every program first, and the result cast after.
- backward: a program per (KV head, 128-key tile, row) streams the q, dO, lse and delta tiles of
  its G query heads; dK and dV stay in registers. Per tile pair, both compute groups write their
  dS into one shared tile (a ring of two, behind a barrier between the two groups), then each
  takes half of the head dims of dQ over all 128 keys and reduce-adds it by TMA into the running
  dq (`jax.new_ref`: in place): five products a tile pair, no second kernel, each dq element
  reduced once a tile pair, and a group's registers (dK, dV, S, dP, half a dQ) within its 232.
  The reduction's order varies, so dq may differ in its last bits from run to run (the Triton
  kernel's is fixed).

Skipping: per (row, program tile) a list of the visible tiles of the other kind, the fully visible
first (`blocks.tile_visibility`). The copy group walks the list; compute groups mask only the
partly visible tiles, by `masks.visible` on segment ids and positions streamed with the tiles.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, masks, target

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
    plgpu = None

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
ROWS = 64  # rows of a compute warp group's tile (one wgmma M)
_DTYPES = (jnp.bfloat16, jnp.float16)


class Tiles(NamedTuple):
    """Keys a forward step streams and the forward's ring of slots; queries a backward step
    streams and the backward's ring. The defaults fill most of an H100's or H200's 227 KiB of
    shared memory at head dim 128 (a third backward slot would not fit)."""

    fwd_k: int = 128
    fwd_steps: int = 2
    bwd_q: int = 64
    bwd_steps: int = 2


TILES = Tiles()


def available() -> bool:
    """Whether the kernel runs where programs are traced for: a Hopper GPU (compute capability 9)
    and a jax with `new_ref` (0.11 or later: dQ accumulates in place)."""
    if plgpu is None or not hasattr(jax, "new_ref") or target.platform() != "gpu":
        return False
    return str(getattr(target.device(), "compute_capability", "")).startswith("9")


def supports(head_dim: int, dtype) -> bool:
    """Whether the kernel takes this head dim and dtype (64 or 128, 16-bit: larger heads do not
    fit the tiles in shared memory); else use `pallas_gpu` or the XLA blocks."""
    return head_dim in (64, 128) and jnp.dtype(dtype) in map(jnp.dtype, _DTYPES)


# ---------------------------------------------------------------------------------------------
# The plan: the list of tiles each program visits.


def _plan(see, full):
    """[B, n_outer, 2 + n_inner] int32 from [B, n_outer, n_inner] visibility: per outer tile, the
    count of fully visible inner tiles, the count of visible ones, then the inner tiles' indices,
    fully visible first, then partly visible, then the rest (never visited)."""
    n = see.shape[-1]
    kind = jnp.where(full, 0, jnp.where(see, 1, 2))
    order = jnp.argsort(kind * n + jnp.arange(n, dtype=jnp.int32), axis=-1).astype(jnp.int32)
    counts = [x.sum(-1, dtype=jnp.int32)[..., None] for x in (full, see)]
    return jnp.concatenate([*counts, order], axis=-1)


def _ids(seg, pos, tile=None):
    """Segment ids and positions as one int32 array: [B, 2, T], or [B, T // tile, 2, tile] for
    tiles that stream (one copy a tile)."""
    ids = jnp.stack([seg, pos], 1).astype(jnp.int32)
    if tile is None:
        return ids
    b, _, t = ids.shape
    return jnp.swapaxes(ids.reshape(b, 2, t // tile, tile), 1, 2)


# ---------------------------------------------------------------------------------------------
# Pieces the kernels share.

_WG = None if plgpu is None else plgpu.Layout.WGMMA
_ROW = None if plgpu is None else _WG.reduce(1)  # one value per row of a wgmma tile
_COL = None if plgpu is None else _WG.reduce(0)  # one value per column
_PARAMS = {} if plgpu is None else dict(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _load(ref, layout):
    """A register array of `ref` (shared or global memory, any strides) in `layout`."""
    return plgpu.load(ref, layout=layout, optimized=False)


def _visible(q_seg, q_pos, k_seg, k_pos, shape, q_axis):
    """`masks.visible` over a tile of `shape` whose queries run along `q_axis` (the operands
    broadcast first: register layouts do not broadcast implicitly)."""
    qs, qp = (lax.broadcast_in_dim(x, shape, [q_axis]) for x in (q_seg, q_pos))
    ks, kp = (lax.broadcast_in_dim(x, shape, [1 - q_axis]) for x in (k_seg, k_pos))
    return masks.visible(qs, qp, ks, kp)


def _stream(count, steps, parts):
    """The copy group's loop: tiles 0..count-1 into slots i % steps. `parts` are (consumed
    barrier, copy(i, slot)) pairs, in order: each buffer of a slot is refilled as soon as both
    compute groups have released that buffer, not the whole slot."""
    for i in range(steps):
        for _, copy in parts:
            pl.when(i < count)(functools.partial(copy, i, i))

    @pl.loop(0, jnp.maximum(count - steps, 0))
    def _(i):
        slot = lax.rem(i, steps)
        for consumed, copy in parts:
            plgpu.barrier_wait(consumed.at[slot])
            copy(i + steps, slot)


def _smem(shape, dtype, swizzle=128):
    """A shared-memory tile in wgmma's layout: rows of `swizzle` bytes, 8-row tiles, swizzled."""
    cols = swizzle // jnp.dtype(dtype).itemsize
    tiling = (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=tiling)


def _kernel(name, body, out_type, grid, names, scratch, args):
    """`body(*refs, scratch)` as a three-warp-group kernel over `grid` (axes `names`), named
    `jspec_attention_mosaic_<name>` in profiles."""

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    call = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=names,
        num_threads=3,
        thread_name="wg",
        kernel_name=f"jspec_attention_mosaic_{name}",
        compiler_params=plgpu.CompilerParams(approx_math=True, **_PARAMS),
    )
    return call(*args)


# ---------------------------------------------------------------------------------------------
# Forward. Scores in base 2: s2 = q.k * scale * log2(e), exp2 instead of exp.


def _fwd_body(plan_ref, q_ref, k_ref, v_ref, idq_ref, idk_ref, o_ref, lse_ref, scratch, *,
              scale, bk, steps, groups, n_tiles, fresh):  # fmt: skip
    """o_ref, lse_ref hold the running (o, lse) and are continued in place; `fresh`: they hold
    nothing yet, and are only written."""
    smem, landed, consumed, schedule = scratch
    row, head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
    qt = n_tiles - 1 - lax.axis_index("q_seq")  # the heaviest (last) query tiles first
    n = plan_ref[row, qt, 1]

    @pl.when(wg < 2)
    def _():
        plgpu.set_max_registers(232, action="increase")
        rows = pl.ds(qt * 2 * ROWS + wg * ROWS, ROWS)
        q_smem, q_landed = smem[0].at[wg], landed[3].at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[row, rows, head], q_smem, q_landed)  # in flight first
        q_ids = [_load(idq_ref.at[row, i, rows], _ROW) for i in (0, 1)]
        out = (o_ref.at[row, rows, head], lse_ref.at[row, head, rows])
        if fresh:
            zeros = jnp.zeros((ROWS, q_ref.shape[-1]), jnp.float32)
            none = jnp.full((ROWS,), -jnp.inf, jnp.float32)
            acc0 = (plgpu.layout_cast(zeros, _WG), plgpu.layout_cast(none, _ROW))
        else:
            acc0 = (_load(out[0], _WG), _load(out[1], _ROW))
        run = functools.partial(_fwd_compute, smem, landed, consumed, schedule, wg, steps)
        run(out, q_ids, acc0, plan_ref[row, qt, 0], n, scale=scale)

    @pl.when(wg == 2)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        k_smem, v_smem, id_smem = smem[1:4]
        kv_head = lax.div(head, groups)
        last = plan_ref.shape[-1] - 3  # the prologue's static steps stay within the plan

        def tile(i):
            return plan_ref[row, qt, 2 + jnp.minimum(i, last)]

        def copy_k(i, slot):
            cols = pl.ds(tile(i) * bk, bk)
            plgpu.copy_gmem_to_smem(
                k_ref.at[row, cols, kv_head], k_smem.at[slot], landed[0].at[slot]
            )

        def copy_ids_v(i, slot):
            j = tile(i)
            plgpu.copy_gmem_to_smem(idk_ref.at[row, j], id_smem.at[slot], landed[2].at[slot])
            plgpu.copy_gmem_to_smem(
                v_ref.at[row, pl.ds(j * bk, bk), kv_head], v_smem.at[slot], landed[1].at[slot]
            )

        _stream(n, steps, ((consumed[0], copy_k), (consumed[1], copy_ids_v)))


def _fwd_compute(smem, landed, consumed, schedule, wg, steps, out, q_ids, acc0, n_full, n, *,
                 scale):  # fmt: skip
    """One compute group's 64 queries (their copy in flight) against the listed key tiles;
    writes (o, lse) to `out`."""
    q_smem, k_smem, v_smem, id_smem, lse_smem = smem
    (k_landed, v_landed, id_landed, q_landed), (k_done, v_done) = landed, consumed
    o_gmem, lse_gmem = out
    q_smem = q_smem.at[wg]
    o0, lse0 = acc0
    bk, d = k_smem.shape[1], q_smem.shape[-1]
    c = scale * _LOG2E
    plgpu.barrier_wait(q_landed.at[wg])

    def turn():  # the two groups take turns on the tensor cores
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    pl.when(n > 0)(lambda: plgpu.barrier_wait(k_landed.at[0]))
    pl.when(wg == 1)(turn)

    def step(i, carry, masked):
        acc, m, l = carry
        slot = lax.rem(i, steps)

        def scores(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
            turn()
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))
        plgpu.barrier_arrive(k_done.at[slot])
        plgpu.barrier_wait(id_landed.at[slot])  # every step, so the barrier's phases stay in step
        if masked:
            k_ids = [_load(id_smem.at[slot, i], _COL) for i in (0, 1)]
            s = jnp.where(_visible(*q_ids, *k_ids, (ROWS, bk), 0), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1) * c)  # m in base-2 units: p's exponent is one FMA
        # A row that has seen nothing keeps m = -inf; exp2 against 0 then gives p = 0.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, (ROWS, bk), [0]))
        acc = acc * lax.broadcast_in_dim(alpha, (ROWS, d), [0])
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(q_smem.dtype)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_landed.at[slot])
        plgpu.barrier_wait(schedule)

        def values(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
            pl.when(i + 1 < n)(lambda: plgpu.barrier_wait(k_landed.at[lax.rem(i + 1, steps)]))

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_done.at[slot])
        return acc, m_new, l

    # Continue the running (o, lse): m = lse, l = 1 (0 where nothing was seen yet), acc = o.
    carry = (o0, lse0 * _LOG2E, jnp.where(lse0 == -jnp.inf, 0.0, 1.0))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n, functools.partial(step, masked=True), carry)
    pl.when(wg == 0)(turn)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_gmem[...] = (acc / lax.broadcast_in_dim(l_safe, (ROWS, d), [0])).astype(o_gmem.dtype)
    lse_smem.at[wg][...] = jnp.where(seen, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "out_dtype"))
def _fwd(q, k, v, q_seg, q_pos, k_seg, k_pos, o0, lse0, *, scale, tiles, out_dtype):
    """(o, lse) continuing the running (o0, lse0), or from nothing where they are None: then the
    kernel writes outputs of its own (o in `out_dtype`), neither zeroed nor read first."""
    b, tq0, hq, d = q.shape
    hkv = k.shape[2]
    bk, steps = tiles.fwd_k, tiles.fwd_steps
    tq, tk = blocks.round_up(tq0, 2 * ROWS), blocks.round_up(k.shape[1], bk)
    q, q_seg, q_pos = (blocks.pad_rows(x, tq) for x in (q, q_seg, q_pos))
    k, v, k_seg, k_pos = (blocks.pad_rows(x, tk) for x in (k, v, k_seg, k_pos))
    plan = _plan(*blocks.tile_visibility(q_seg, q_pos, k_seg, k_pos, 2 * ROWS, bk))
    n_tiles = tq // (2 * ROWS)
    scratch = (
        (
            _smem((2, ROWS, d), q.dtype),
            _smem((steps, bk, d), q.dtype),
            _smem((steps, bk, d), q.dtype),
            plgpu.SMEM((steps, 2, bk), jnp.int32),
            plgpu.SMEM((2, ROWS), jnp.float32),
        ),
        (*(plgpu.Barrier(num_barriers=steps),) * 3, plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=steps),) * 2,
        plgpu.Barrier(num_arrivals=2),
    )
    fresh = o0 is None
    body = functools.partial(
        _fwd_body, scale=scale, bk=bk, steps=steps, groups=hq // hkv, n_tiles=n_tiles, fresh=fresh
    )
    grid, names = (hq, n_tiles, b), ("heads", "q_seq", "batch")
    args = (plan, q, k, v, _ids(q_seg, q_pos), _ids(k_seg, k_pos, bk))
    if fresh:  # the statistics heads first (a tile's values contiguous)
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        out = (jax.ShapeDtypeStruct((b, tq, hq, d), out_dtype), f32(b, hq, tq))
        o, lse = _kernel("fwd", body, out, grid, names, scratch, args)
    else:  # continued in place
        o0, lse0 = (blocks.pad_rows(x, tq) for x in (o0, lse0))
        o, lse = jax.new_ref(o0), jax.new_ref(jnp.swapaxes(lse0, 1, 2))
        _kernel("fwd", body, (), grid, names, scratch, (*args, o, lse))
        o, lse = o[...], lse[...]
    return o[:, :tq0], jnp.swapaxes(lse, 1, 2)[:, :tq0]


# ---------------------------------------------------------------------------------------------
# Backward: dK, dV and (reduced into the running dq) dQ in one kernel.


def _bwd_body(plan_ref, q_ref, k_ref, v_ref, do_ref, idq_ref, idk_ref, lse_ref, delta_ref, dq_ref,
              dk_ref, dv_ref, scratch, *, scale, bq, steps, groups):  # fmt: skip
    smem, landed, done, own, ds_ready = scratch
    row, kv_head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
    kt = lax.axis_index("k_seq")
    n = plan_ref[row, kt, 1]

    def tile(i):  # step i's query head and query tile
        return kv_head * groups + lax.div(i, n), plan_ref[row, kt, 2 + lax.rem(i, n)]

    @pl.when(wg < 2)
    def _():
        plgpu.set_max_registers(232, action="increase")
        cols = pl.ds(kt * 2 * ROWS + wg * ROWS, ROWS)
        k_ids = [_load(idk_ref.at[row, i, cols], _ROW) for i in (0, 1)]
        kv = (k_ref.at[row, cols, kv_head], v_ref.at[row, cols, kv_head])
        out = (dk_ref.at[row, cols, kv_head], dv_ref.at[row, cols, kv_head])
        half = dq_ref.shape[-1] // 2

        def dq_dest(i):  # this group's half of the head dims
            h, j = tile(i)
            return dq_ref.at[row, pl.ds(j * bq, bq), h, pl.ds(wg * half, half)]

        bars = (*landed, done, own, ds_ready)
        run = functools.partial(_bwd_compute, smem, bars, wg, steps)
        run(kv, out, k_ids, dq_dest, plan_ref[row, kt, 0], n, groups, scale=scale)

    @pl.when(wg == 2)
    def _():
        plgpu.set_max_registers(40, action="decrease")

        def copy(i, slot):  # in the order the compute groups wait for them
            h, j = tile(i)
            rows = pl.ds(j * bq, bq)
            srcs = (q_ref.at[row, rows, h], do_ref.at[row, rows, h], lse_ref.at[row, h, rows])
            srcs += (idq_ref.at[row, j], delta_ref.at[row, h, rows])
            for src, dst, bar in zip(srcs, smem[2:7], landed, strict=True):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

        _stream(groups * n, steps, ((done, copy),))


def _bwd_compute(smem, bars, wg, steps, kv, out, k_ids, dq_dest, n_full, n, groups, *,
                 scale):  # fmt: skip
    """One compute group's 64 keys against the listed query tiles of its G query heads: dK, dV
    written, each step's dQ (its half of the head dims) reduced into the running dq."""
    k_smem, v_smem, own = smem[0], smem[1], bars[6]
    plgpu.copy_gmem_to_smem(kv[0], k_smem.at[pl.ds(wg * ROWS, ROWS)], own.at[wg])
    plgpu.copy_gmem_to_smem(kv[1], v_smem.at[wg], own.at[2 + wg])
    for b in (0, 1, 2 + wg):  # dQ reads the other group's keys too
        plgpu.barrier_wait(own.at[b])
    step = functools.partial(_bwd_step, smem, bars, wg, steps, k_ids, dq_dest, scale=scale)

    def head(h, carry):
        carry = lax.fori_loop(h * n, h * n + n_full, functools.partial(step, masked=False), carry)
        return lax.fori_loop(
            h * n + n_full, (h + 1) * n, functools.partial(step, masked=True), carry
        )

    zeros = plgpu.layout_cast(jnp.zeros((ROWS, k_smem.shape[-1]), jnp.float32), _WG)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    out[0][...] = dk * scale
    out[1][...] = dv
    plgpu.wait_smem_to_gmem(0)


def _bwd_step(smem, bars, wg, steps, k_ids, dq_dest, i, carry, *, masked, scale):
    """Step i of a compute group: S, dP; P, dS (into the shared dS tile); dV, dK; then, once both
    groups' dS are in, this group's half of the head dims of dQ over all 128 keys."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, id_smem, delta_smem, ds_smem, dq_smem = smem
    q_landed, do_landed, lse_landed, id_landed, delta_landed, done, _, ds_ready = bars
    dk, dv = carry
    slot, buf = lax.rem(i, steps), lax.rem(i, 2)
    dest = dq_dest(i)  # read from the plan before anything waits
    bq, half = dq_smem.shape[1:]
    tile, dtype = (ROWS, bq), k_smem.dtype  # transposed: keys along rows
    # wg, but not to the compiler (i >= 0): K's and V's wgmma descriptors are then made in the
    # loop, not held in registers across it (ptxas spilled them: 244 bytes of spill stores).
    wg_ = wg + lax.shift_right_logical(i, 31)
    plgpu.barrier_wait(q_landed.at[slot])

    def scores(s_ref, dp_ref):  # P while dP is in flight
        plgpu.wgmma(s_ref, k_smem.at[pl.ds(wg_ * ROWS, ROWS)], q_smem.at[slot].T)
        plgpu.barrier_wait(do_landed.at[slot])
        plgpu.wgmma(dp_ref, v_smem.at[wg_], do_smem.at[slot].T)
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        plgpu.barrier_wait(lse_landed.at[slot])
        lse = _load(lse_smem.at[slot], _COL)  # base 2
        p = jnp.exp2(s * (scale * _LOG2E) - lax.broadcast_in_dim(lse, tile, [1]))
        plgpu.barrier_wait(id_landed.at[slot])
        if masked:
            q_ids = [_load(id_smem.at[slot, i], _COL) for i in (0, 1)]
            p = jnp.where(_visible(*q_ids, *k_ids, tile, 1), p, 0.0)
        return p, dp_ref[...]

    p, dp = pl.run_scoped(scores, *(plgpu.ACC(tile, jnp.float32),) * 2)
    plgpu.barrier_wait(delta_landed.at[slot])
    delta = _load(delta_smem.at[slot], _COL)
    p, ds = p.astype(dtype), (p * (dp - lax.broadcast_in_dim(delta, tile, [1]))).astype(dtype)
    ds_smem.at[buf, pl.ds(wg * ROWS, ROWS)][...] = ds
    plgpu.commit_smem()
    plgpu.barrier_arrive(ds_ready.at[buf])

    def products(refs):
        dk_ref, dv_ref, dq_ref = refs
        plgpu.wgmma(dv_ref, p, do_smem.at[slot])
        plgpu.wgmma(dk_ref, ds, q_smem.at[slot])
        plgpu.barrier_wait(ds_ready.at[buf])  # both groups' dS
        plgpu.wgmma(dq_ref, ds_smem.at[buf].T, k_smem.at[:, pl.ds(wg_ * half, half)])

    zeros = plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), _WG)
    dk, dv, dq = pl.run_state(products)(tuple(map(plgpu.ACC.init, (dk, dv, zeros))))
    plgpu.barrier_arrive(done.at[slot])
    dq_smem = dq_smem.at[wg]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduction has read dq_smem
    dq_smem[...] = dq * scale
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dest, reduction_op="add")
    return dk, dv


@functools.partial(jax.jit, static_argnames=("scale", "tiles"))
def _bwd(q, k, v, q_seg, q_pos, k_seg, k_pos, lse, dout, delta, dq0, *, scale, tiles):
    """(dq0 plus this key set's dq, dk, dv): inputs padded to whole tiles, the statistics made
    heads-first (lse in base 2), one kernel."""
    b, tq0, hq, d = q.shape
    tk0, hkv = k.shape[1:3]
    bq, steps = tiles.bwd_q, tiles.bwd_steps
    tq, tk = blocks.round_up(tq0, bq), blocks.round_up(tk0, 2 * ROWS)
    q, dout, q_seg, q_pos, dq0 = (blocks.pad_rows(x, tq) for x in (q, dout, q_seg, q_pos, dq0))
    k, v, k_seg, k_pos = (blocks.pad_rows(x, tk) for x in (k, v, k_seg, k_pos))
    lse, delta = (jnp.swapaxes(blocks.pad_rows(x, tq), 1, 2) for x in (lse * _LOG2E, delta))
    see, full = blocks.tile_visibility(q_seg, q_pos, k_seg, k_pos, bq, 2 * ROWS)
    plan = _plan(jnp.swapaxes(see, 1, 2), jnp.swapaxes(full, 1, 2))
    # dQ takes column halves of K: rows of d / 2 elements, as all operands of a wgmma share them.
    tiles16 = functools.partial(_smem, dtype=k.dtype, swizzle=min(128, d * k.dtype.itemsize // 2))
    scratch = (
        (
            tiles16((2 * ROWS, d)),
            tiles16((2, ROWS, d)),
            tiles16((steps, bq, d)),
            tiles16((steps, bq, d)),
            plgpu.SMEM((steps, bq), jnp.float32),
            plgpu.SMEM((steps, 2, bq), jnp.int32),
            plgpu.SMEM((steps, bq), jnp.float32),
            tiles16((2, 2 * ROWS, bq)),  # a ring of two: the next step's dS may land
            _smem((2, bq, d // 2), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=steps),) * 5,
        plgpu.Barrier(num_arrivals=2, num_barriers=steps),
        plgpu.Barrier(num_barriers=4),
        plgpu.Barrier(num_arrivals=2, num_barriers=2),
    )
    body = functools.partial(_bwd_body, scale=scale, bq=bq, steps=steps, groups=hq // hkv)
    dq = jax.new_ref(dq0)
    f32 = jax.ShapeDtypeStruct(k.shape, jnp.float32)
    args = (plan, q, k, v, dout, _ids(q_seg, q_pos, bq), _ids(k_seg, k_pos), lse, delta, dq)
    grid = (hkv, tk // (2 * ROWS), b)
    dk, dv = _kernel("bwd", body, (f32, f32), grid, ("heads", "k_seq", "batch"), scratch, args)
    return dq[...][:, :tq0], dk[:, :tk0], dv[:, :tk0]


# ---------------------------------------------------------------------------------------------
# The entry points: `blocks.fwd` / `blocks.bwd`'s signatures.


def _undivided(kernel, *args, **static):
    """kernel(*args, **static), which autodiff's partial evaluation never splits. Under remat (the
    model's `jax.checkpoint`) a jit or scan around the kernel is split into what remat saves and
    what it recomputes, and the kernel's in-place buffer (`jax.new_ref`) would pass between the
    halves, which JAX refuses; a custom_vjp is kept whole. The gradient is the ring's custom_vjp:
    this one is never differentiated."""

    def not_differentiated(*_):
        raise NotImplementedError("the Mosaic GPU kernels are differentiated by jspec.attention")

    call = jax.custom_vjp(functools.partial(kernel, **static))
    call.defvjp(lambda *a: (kernel(*a, **static), None), not_differentiated)
    return call(*args)


def _check(q, k, tiles: Tiles):
    d = q.shape[-1]
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}.")
    if not supports(d, k.dtype):
        raise ValueError(
            f"the Mosaic GPU kernel takes head dim 64 or 128 in bfloat16 or float16; got {d} in "
            f"{jnp.dtype(k.dtype).name}: use impl='pallas' or 'xla'."
        )
    if tiles.fwd_k % 64 or tiles.bwd_q % 64 or min(tiles.fwd_steps, tiles.bwd_steps) < 2:
        raise ValueError(f"tiles must be multiples of 64 with at least 2 steps; got {tiles}.")


def fwd(
    q: Float[Array, "b tq hq d"],
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    q_seg: Int[Array, "b tq"],
    q_pos: Int[Array, "b tq"],
    k_seg: Int[Array, "b tk"],
    k_pos: Int[Array, "b tk"],
    acc: tuple[Float[Array, "b tq hq d"], Float[Array, "b tq hq"]] | None = None,
    *,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: Tiles | None = None,
    out_dtype=jnp.float32,
) -> tuple[Float[Array, "b tq hq d"], Float[Array, "b tq hq"]]:
    """`blocks.fwd` on a Hopper GPU: the running output (float32, normalised) and log-sum-exp
    `acc` continued with k, v. block_q / block_k keep `blocks`' signature and are unused. With no
    `acc` the output is written in `out_dtype` (the ring's q dtype, where nothing continues it)."""
    del block_q, block_k
    tiles = tiles or TILES
    _check(q, k, tiles)
    q, v = q.astype(k.dtype), v.astype(k.dtype)
    args = (q, k, v, q_seg, q_pos, k_seg, k_pos, *(acc or (None, None)))
    static = dict(scale=float(scale), tiles=tiles, out_dtype=jnp.dtype(out_dtype))
    return _undivided(_fwd, *args, **static)


def bwd(
    q: Float[Array, "b tq hq d"],
    k: Float[Array, "b tk hkv d"],
    v: Float[Array, "b tk hkv d"],
    q_seg: Int[Array, "b tq"],
    q_pos: Int[Array, "b tq"],
    k_seg: Int[Array, "b tk"],
    k_pos: Int[Array, "b tk"],
    lse: Float[Array, "b tq hq"],
    dout: Float[Array, "b tq hq d"],
    delta: Float[Array, "b tq hq"],
    dq: Float[Array, "b tq hq d"] | None = None,
    *,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: Tiles | None = None,
):
    """`blocks.bwd` on a Hopper GPU: float32 (dq, dk, dv) for this key set, given the global lse
    and delta; dq is added to the `dq` given."""
    del block_q, block_k
    tiles = tiles or TILES
    _check(q, k, tiles)
    q, v, dout = (x.astype(k.dtype) for x in (q, v, dout))
    dq = jnp.zeros(q.shape, jnp.float32) if dq is None else dq
    lse, delta = (x.astype(jnp.float32) for x in (lse, delta))
    args = (q, k, v, q_seg, q_pos, k_seg, k_pos, lse, dout, delta, dq)
    return _undivided(_bwd, *args, scale=float(scale), tiles=tiles)
