"""The contract's entry points, `attention` (one device) and `ring_attention` (a rank of a ring,
inside `shard_map`): their inputs checked in the caller's terms, trunk and branch queries joined
into one array, padded to the kernel's tiles, then either the ring's one custom_vjp (`ring.py`;
on one device a ring of one step) or, for `impl="decode"`, few-query attention (`decode.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jspec.attention import blocks, checks, decode, masks, mosaic_gpu, pallas_gpu, pallas_tpu, ring
from jspec.attention.branch import Branch

BLOCK_Q = 512
BLOCK_K = 512
PALLAS_PAD = 128  # a multiple of every Pallas tile, so the kernel never pads per ring step
# The block kernel: "xla" (portable), "pallas" (NVIDIA GPU, Triton), "mosaic" (Hopper GPU, Pallas'
# Mosaic GPU backend: head dim 64 or 128, 16-bit), "pallas_tpu" (TPU), either Pallas kernel of the
# first kind in Pallas' interpreter on any backend ("pallas_interpret", "pallas_tpu_interpret":
# slow, for tests); "auto" takes the fastest Pallas kernel of the backend where it runs (on Hopper
# the Mosaic GPU one where it takes the head dim and dtype, else the Triton one), and elsewhere
# XLA's path, or the TPU kernel in a program compiled for a TPU (a CPU host compiling for a TPU).
# "decode": few queries per row against a long cache, on one device (`decode.py`: rollouts).
IMPLS = (
    "auto",
    "xla",
    "pallas",
    "pallas_interpret",
    "mosaic",
    "pallas_tpu",
    "pallas_tpu_interpret",
    "decode",
)


def _resolve(impl: str, head_dim: int, dtype) -> str:
    """The kernel `ring.Static` runs ("xla_or_tpu": XLA's path unless compiled for a TPU)."""
    if impl == "auto":
        if pallas_tpu.available():
            return "pallas_tpu"
        if mosaic_gpu.available() and mosaic_gpu.supports(head_dim, dtype):
            return "mosaic"
        if pallas_gpu.available() and pallas_gpu.supports(head_dim):
            return "pallas"
        return "xla_or_tpu"
    if impl == "pallas" and not pallas_gpu.available():
        raise ValueError(
            "impl='pallas' needs an NVIDIA GPU with Pallas' Triton backend; use impl='auto' or "
            "'xla' here (or 'pallas_interpret' to run the kernel in the interpreter)."
        )
    if impl == "mosaic" and not mosaic_gpu.available():
        raise ValueError(
            "impl='mosaic' needs a Hopper GPU (compute capability 9) and jax >= 0.11; use "
            "impl='auto' here."
        )
    if impl == "mosaic" and not mosaic_gpu.supports(head_dim, dtype):
        raise ValueError(
            f"impl='mosaic' takes head dim 64 or 128 in bfloat16 or float16, got {head_dim} in "
            f"{jnp.dtype(dtype).name}; use impl='pallas' or 'xla'."
        )
    if impl in ("pallas", "pallas_interpret") and not pallas_gpu.supports(head_dim):
        raise ValueError(
            f"impl={impl!r} needs a head dim that is a power of two >= 16, got {head_dim}; "
            "use impl='xla'."
        )
    return impl


def _check_tiles(tiles, kernel: str) -> None:
    """Tiles of the kernel that runs (another kernel's would fail deep inside it)."""
    kind = {"mosaic": mosaic_gpu.Tiles, "pallas_tpu": pallas_tpu.Tiles}.get(
        kernel.removesuffix("_interpret"), pallas_gpu.Tiles
    )
    if tiles is not None and kernel.startswith(("pallas", "mosaic")) and type(tiles) is not kind:
        raise TypeError(
            f"tiles={tiles!r} are not the tiles of the {kernel!r} kernel: pass "
            f"{kind.__module__.removeprefix('jspec.attention.')}.{kind.__name__}(...) or None."
        )


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
    checks.check_tile_sizes(block_q=block_q, block_k=block_k)
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

    kernel = _resolve(impl, k.shape[-1], k.dtype)
    _check_tiles(tiles, kernel)
    if kernel in ("xla", "xla_or_tpu"):
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

    st = ring.Static(kernel, axis_name, scale, block_q, block_k, (n_trunk, n_rows), tiles)
    args = (q_all, q_seg, q_pos, k_all, v_all, k_seg, k_pos, bk, bv, b_nodes, parent)
    out = ring.run(st, *(ring.varying(x, axis_name) for x in args))
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
    tiles: pallas_gpu.Tiles | mosaic_gpu.Tiles | pallas_tpu.Tiles | None = None,
    decode_options: decode.DecodeOptions | None = None,
    heads_major: bool = False,
):
    """Masked attention on one device, blockwise (no score tile beyond a block), differentiable.

    Returns the trunk output [B,Tq,Hq,D] (None when q is None), or `(out, branch_out)` with a
    branch. `block_q`, `block_k` set the tile of the XLA blocks (default 512 x 512, clipped to the
    lengths), `tiles` those of the Pallas kernel (`pallas_gpu.Tiles`, `mosaic_gpu.Tiles` or
    `pallas_tpu.Tiles`; None: the kernel's default), `decode_options` how `impl="decode"` runs
    (None: `decode.DecodeOptions()`). Visibility is the contract's (docs/attention.md);
    `reference.py` is its dense statement. `heads_major`: k and v are [B,Hkv,Tk,D], a KV cache's
    layout, which `impl="decode"` reads as it is (the other paths transpose it).
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
    tiles: pallas_gpu.Tiles | mosaic_gpu.Tiles | pallas_tpu.Tiles | None = None,
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
