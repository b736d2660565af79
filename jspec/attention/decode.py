"""A few queries per row against a long KV cache: the attention of decode and verification.

Rollouts ask a handful of queries per row (one decoded token, a draft tree of a few dozen nodes)
against thousands of cached keys. The block kernels tile queries by 128 rows and run one program
per query head, so every KV head's cache is read once per query head, and they pad the cache to a
multiple of their tile (a copy per call). Here all queries of a row and all query heads of a KV
group share one read of each cache chunk: one grouped einsum [B, K, G, R, chunk] of scores, masked
by the contract's rules (`masks`), continued across chunks by online softmax in float32; the
branch keys (a few per row) join the same softmax. Autodiff works, but the path is meant for
rollouts: training keeps the block kernels (`impl="decode"` selects this path). On an NVIDIA GPU the
cache part and the tree's keys run as a Pallas kernel (`pallas_decode`: scores stay on chip, only
filled slots are read); the XLA path here is its reference and its gradient.

The cache is heads-major, [B, Hkv, S, D]: the einsums batch over (row, KV head), and a batched
matrix product wants its batch dimensions outermost, so a [B, S, Hkv, D] cache would be transposed
(copied whole) in every layer of every step before it is read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jspec.attention import masks, pallas_decode, pallas_gpu, pallas_tpu, pallas_tpu_decode
from jspec.attention.blocks import _finish, round_up

CHUNK = 4096  # cache slots per step of the XLA path's online softmax: bounds the score buffer
# (query row, tree node) pairs per row up to which the tree's part is summed in place (`_branch`):
# verifying up to 11 nodes, the root and a tree of 10 (a chain of 6 with 4 siblings, a dynamic 8)
SUMMED_PAIRS = 128
# What folds the cache in: "auto" (the Pallas kernel on a GPU or a TPU, XLA elsewhere, or the TPU
# kernel in a program compiled for a TPU), "xla",
# "pallas" (NVIDIA GPUs), "pallas_tpu", or either kernel in Pallas' interpreter ("pallas_interpret",
# "pallas_tpu_interpret": slow, for tests on the CPU).
BACKENDS = ("auto", "xla", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How `decode_attention` computes (static, hashable): what folds the cache in (`backend`, of
    `BACKENDS`), the XLA path's cache slots per step (`chunk`) and (query row, tree node) pairs per
    row up to which it sums the tree's part in place (`summed_pairs`), and how the Pallas kernel
    cuts its work (`tiling`). The defaults are what rollouts run; tests and benchmarks pass others.
    """

    backend: str = "auto"
    chunk: int = CHUNK
    summed_pairs: int = SUMMED_PAIRS
    tiling: pallas_decode.Tiling = pallas_decode.TILING

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(
                f"DecodeOptions backend={self.backend!r} is not one of {', '.join(BACKENDS)}."
            )


def _continue(state, s, scale, weigh):
    """Online softmax: fold scores s [..., C] (-inf where masked) in, state (m, l, acc) [...(, D)];
    `weigh(p)` is the values weighted by p [..., C], summed over C, in float32."""
    m, l, acc = state
    s = s * scale
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + weigh(p)


def decode_attention(
    q: Float[Array, "b r hq d"],
    q_segment_ids: Int[Array, "b r"],
    q_positions: Int[Array, "b r"],
    k: Float[Array, "b hkv s d"],
    v: Float[Array, "b hkv s d"],
    segment_ids: Int[Array, "b s"],
    positions: Int[Array, "b s"],
    nodes: Int[Array, "b r"] | None,
    branch_k: Float[Array, "b n hkv d"] | None,
    branch_v: Float[Array, "b n hkv d"] | None,
    parent: Int[Array, "b n"] | None,
    *,
    scale: float,
    options: DecodeOptions | None = None,
) -> Float[Array, "b r hq d"]:
    """Output (float32) of R query rows: trunk rule by (q_segment_ids, q_positions), and for rows
    whose `nodes` entry is a branch node (>= 0), that node and its ancestors among the branch keys.
    `options` None: `DecodeOptions()`.
    """
    options = options or DecodeOptions()
    b, r, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, r, hkv, hq // hkv, d)
    branch = None
    if branch_k is not None:
        ancestors = masks.ancestor_mask(parent)  # [B, N, N]: small trees only
        seen = jnp.take_along_axis(ancestors, jnp.maximum(nodes, 0)[:, :, None], axis=1)
        seen = seen & (nodes >= 0)[:, :, None]
        branch = (*(jnp.moveaxis(x, 1, 2) for x in (branch_k, branch_v)), seen)
    args = (qg, q_segment_ids, q_positions, k, v, segment_ids, positions, branch)
    xla = functools.partial(
        xla_state, scale=scale, chunk=options.chunk, summed_pairs=options.summed_pairs
    )
    backend = attention_backend(options.backend, d)

    def on(kernel):  # the Pallas kernel `kernel` ("pallas..." or "pallas_tpu..."), XLA's gradient
        return lambda *a: pallas_decode.attention_state(
            *a,
            xla,
            scale=scale,
            interpret=kernel.endswith("interpret"),
            tiling=options.tiling,
            kernel_state=pallas_tpu_decode.kernel_state
            if kernel.startswith("pallas_tpu")
            else pallas_decode.kernel_state,
        )

    if backend == "xla":
        state = xla(*args)
    elif backend == "xla_or_tpu":  # chosen when lowering, as the block kernels' (`ring.py`)
        state = jax.lax.platform_dependent(*args, tpu=on("pallas_tpu"), default=xla)
    else:
        state = on(backend)(*args)
    out, _ = _finish(*state)
    return out.reshape(b, r, hq, d)


def xla_state(
    qg,
    q_segment_ids,
    q_positions,
    k,
    v,
    segment_ids,
    positions,
    branch=None,
    *,
    scale,
    chunk: int = CHUNK,
    summed_pairs: int = SUMMED_PAIRS,
):
    """The online-softmax state (m, l, acc) [B,R,K,G(,D)] of queries qg [B,R,K,G,D] after every
    cache slot and (`branch`: keys and values [B,K,N,D], which of them each query sees [B,R,N])
    every tree node they see, in XLA (`chunk`, `summed_pairs`: as `DecodeOptions`)."""
    trunk = (qg, q_segment_ids, q_positions, k, v, segment_ids, positions)
    state = xla_trunk(*trunk, scale=scale, chunk=chunk)
    state = tuple(jnp.moveaxis(x, 3, 1) for x in state)  # the queries' layout
    return state if branch is None else _branch(state, qg, *branch, scale, summed_pairs)


def _branch(state, qg, k_BKND, v_BKND, seen, scale, summed_pairs: int):
    """Online softmax: fold the branch keys in (the tree's nodes, a few per row) for the queries
    `qg` [B,R,K,G,D] that see them (`seen` [B,R,N]), in the queries' layout. Up to `summed_pairs`
    (query, node) pairs a row, scores and values are products summed by XLA reductions, not
    matrix products: a matrix product batched over (row, KV head) wants those axes outermost, and
    moving the query rows behind them copies the queries, the branch keys and values and the output
    of every layer (a kernel each, as costly as the work at a few nodes). Beyond, the work outgrows
    the copies, and the tensor cores take it."""
    f32 = lambda x: x.astype(jnp.float32)
    summed = qg.shape[1] * k_BKND.shape[2] <= summed_pairs
    if summed:
        s = jnp.sum(f32(qg)[:, :, :, :, None] * f32(k_BKND)[:, None, :, None], axis=-1)
    else:
        s = jnp.einsum("brkgd,bknd->brkgn", qg, k_BKND, preferred_element_type=jnp.float32)

    def weigh(p):  # p in the values' dtype, as the trunk takes it
        p = p.astype(v_BKND.dtype)
        if summed:
            return jnp.sum(f32(p)[..., None] * f32(v_BKND)[:, None, :, None], axis=-2)
        return jnp.einsum("brkgn,bknd->brkgd", p, v_BKND, preferred_element_type=jnp.float32)

    return _continue(state, jnp.where(seen[:, :, None, None], s, -jnp.inf), scale, weigh)


def cache_slots(tokens: int, limit: int | None = None) -> int:
    """Slots for a cache of `tokens`: whole blocks of the Pallas trunk's default tiling (which
    otherwise pads, a copy of the cache per call), but at most `limit` (when given)."""
    whole = round_up(tokens, pallas_decode.TILING.block_k)
    return max(tokens, whole if limit is None else min(limit, whole))


def attention_backend(backend: str, head_dim: int) -> str:
    """What folds the cache and the tree's keys in: `backend`, with "auto" the Pallas kernel on an
    NVIDIA GPU that can run it, the TPU kernel on a TPU, and elsewhere "xla_or_tpu": XLA, or the
    TPU kernel in a program compiled for a TPU (a CPU host compiling for a TPU slice)."""
    if backend != "auto":
        return backend
    if pallas_tpu.available():
        return "pallas_tpu"
    if pallas_gpu.available() and pallas_gpu.supports(head_dim):
        return "pallas"
    return "xla_or_tpu"


def xla_trunk(qg, q_segment_ids, q_positions, k, v, segment_ids, positions, *, scale, chunk: int):
    """The online-softmax state (m, l, acc) [B,K,G,R(,D)] of queries qg [B,R,K,G,D] after every
    cache slot they see, `chunk` slots at a time in XLA."""
    b, r, hkv, g, d = qg.shape
    shape = (b, hkv, g, r)
    state = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, d), jnp.float32),
    )

    def trunk_chunk(state, start, size):
        sl = lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
        seen = masks.visible(
            q_segment_ids[:, :, None],
            q_positions[:, :, None],
            sl(segment_ids)[:, None],
            sl(positions)[:, None],
        )
        s = jnp.einsum("brkgd,bkcd->bkgrc", qg, sl(k, 2), preferred_element_type=jnp.float32)
        s = jnp.where(seen[:, None, None], s, -jnp.inf)
        # p in the values' dtype (as flash attention does): a float32 copy of the cache costs more
        weigh = lambda p: jnp.einsum(
            "bkgrc,bkcd->bkgrd", p.astype(v.dtype), sl(v, 2), preferred_element_type=jnp.float32
        )
        return _continue(state, s, scale, weigh)

    full, rest = divmod(k.shape[2], chunk)
    if full > 1:
        body = lambda state, i: (trunk_chunk(state, i * chunk, chunk), None)
        state, _ = jax.lax.scan(body, state, jnp.arange(full))
    elif full == 1:
        state = trunk_chunk(state, 0, chunk)
    if rest:
        state = trunk_chunk(state, full * chunk, rest)
    return state
