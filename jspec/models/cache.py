"""The KV cache of rollouts and the attention of rollout queries against it.

`KVCache` holds one document per row in static-shape slots, heads-major per layer; prefill and
decode write it layer by layer in place (`CacheWriter`), and so does the verify of a chain, which
then forgets the rejected nodes (`KVCache.forget`); the verify of another tree appends the
accepted nodes (`KVCache.append`); `TreeKV` holds the nodes of a tree expansion's earlier steps.
Rollout queries attend to a layer of the cache through `rollout_attention`, on the kernels of a
`KernelConfig` (a static choice of `RolloutConfig.kernels`).

Shape suffixes: B batch, T tokens, N new tokens or nodes, C earlier nodes, S cache slots, L layers,
K key/value heads, E head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention import Branch, attention
from jspec.attention.decode import DecodeOptions, attention_backend
from jspec.attention.zigzag import concrete
from jspec.config import KernelConfig
from jspec.models import layers, qkv_epilogue

KV = Float[Array, "l b n kv e"]  # keys or values of N new tokens, every layer


class KVCache(NamedTuple):
    """Static-shape KV cache (a pytree), one document per row.

    Slot i of row b holds the token at position i; slots at or past `length[b]` carry segment 0, so
    attention never sees them, whatever their K/V. `overflowed[b]` marks a row that was asked to
    hold more tokens than it has slots (only possible under `jit`, where the lengths are not
    known before running): its extra tokens were dropped and its results must not be used.
    """

    # One array per layer, heads-major [B,Hkv,S,E]: the layout decode attention reads (`decode`),
    # and no layer is sliced out of a stack (a copy of it whenever a kernel reads it).
    k: tuple[Float[Array, "b kv s e"], ...]
    v: tuple[Float[Array, "b kv s e"], ...]
    segment_ids: Int[Array, "b s"]
    positions: Int[Array, "b s"]
    length: Int[Array, " b"]
    overflowed: Bool[Array, " b"]

    def slots(self, count: Int[Array, " b"], n: int) -> Int[Array, "b n"]:
        """Where the first `count[b]` of n new tokens of row b go; the others get slots past the
        end (`s + j`: dropped, and distinct, as `write_kv` tells XLA every slot is).

        Raises if the values are concrete and some row has no room for its tokens.
        """
        b, s = self.segment_ids.shape
        if concrete(self.length, count):
            over = np.flatnonzero(np.asarray(self.length) + np.asarray(count) > s)
            if over.size:
                r = int(over[0])
                raise ValueError(
                    f"row {r} of the KV cache holds {int(self.length[r])} of {s} slots and cannot "
                    f"take {int(count[r])} more tokens; make the cache longer (init_cache max_len) "
                    "or write fewer tokens."
                )
        j = jnp.arange(n, dtype=jnp.int32)
        return jnp.where(j < count[:, None], self.length[:, None] + j, s + j)

    def append(self, k: KV, v: KV, count: Int[Array, " b"]) -> KVCache:
        """Writes the first `count[b]` of the N new tokens of row b at slots `length[b]` onwards.

        Accepted draft paths grow the cache through here; prefill and decode write layer by layer
        with `slots` and `with_tokens`.
        """
        slot_BN = self.slots(count, k.shape[2])
        write = lambda layers, new: tuple(
            map(functools.partial(write_kv, slot_BN=slot_BN), layers, new)
        )
        return self.with_tokens(slot_BN, count)._replace(k=write(self.k, k), v=write(self.v, v))

    def forget(self, length: Int[Array, " b"]) -> KVCache:
        """The cache cut back to its first `length[b]` tokens a row: the slots after carry
        segment 0 again (a chain's rejected nodes, written before they were verified)."""
        kept = jnp.arange(self.segment_ids.shape[1]) < length[:, None]
        return self._replace(segment_ids=jnp.where(kept, self.segment_ids, 0), length=length)

    def put_rows(self, row: Int[Array, " r"], new: KVCache) -> KVCache:
        """This cache with rows `row` (past the last: dropped) replaced by the rows of `new`, which
        may have fewer slots (a prefill's, as long as its prompts): they go to the first slots,
        and the rest of the row is emptied (segment 0), its K/V left as they were (nothing
        attends to them). So a prefill moves its prompts' K/V, not a whole row's capacity."""
        s, n = self.segment_ids.shape[1], new.segment_ids.shape[1]
        if n > s:
            raise ValueError(f"rows of {n} slots do not fit a cache of {s} slots a row.")
        put = lambda old, x: old.at[row].set(x, mode="drop")
        prefix = lambda old, x: old.at[row, :, :n].set(x, mode="drop")
        padded = lambda x: jnp.pad(x, ((0, 0), (0, s - n)))
        return KVCache(
            k=tuple(map(prefix, self.k, new.k)),
            v=tuple(map(prefix, self.v, new.v)),
            segment_ids=put(self.segment_ids, padded(new.segment_ids)),
            positions=put(self.positions, padded(new.positions)),
            length=put(self.length, new.length),
            overflowed=put(self.overflowed, new.overflowed),
        )

    def with_tokens(self, slot_BN: Int[Array, "b n"], count: Int[Array, " b"]) -> KVCache:
        """The cache's ids, positions and lengths after writing tokens at `slot_BN` (K/V as they
        were); a row whose tokens do not all fit is marked `overflowed`."""
        b, s = self.segment_ids.shape
        put = lambda a, x: a.at[jnp.arange(b)[:, None], slot_BN].set(x, mode="drop")
        wanted = self.length + count.astype(jnp.int32)
        return self._replace(
            segment_ids=put(self.segment_ids, 1),
            positions=put(self.positions, slot_BN),
            length=jnp.minimum(wanted, s),
            overflowed=self.overflowed | (wanted > s),
        )


def write_kv(cache_kv: Array, new_kv: Array, slot_BN: Int[Array, "b n"]) -> Array:
    """Writes a layer's new K or V [B,N,K,E] at the slots of each row of its cache [B,K,S,E] (in
    place under `jit` when the cache is donated or carried). Slots past the end are dropped.

    The slots a call writes are distinct (`KVCache.slots`, past the end too), and saying so lets
    XLA's GPU scatter store them without the atomic updates it makes where indices may repeat: a
    plain decode step of the 1.4B code model at batch 1 took 1.41 ms on an H200, 1.50 before."""
    rows = jnp.arange(slot_BN.shape[0])[:, None, None]
    heads = jnp.arange(cache_kv.shape[1])[None, :, None]
    new = jnp.swapaxes(new_kv, 1, 2).astype(cache_kv.dtype)  # [B, K, N, E]
    return cache_kv.at[rows, heads, slot_BN[:, None, :]].set(new, mode="drop", unique_indices=True)


class CacheWriter:
    """Attention of T new tokens per row that continue the cache's documents: each layer writes the
    tokens' K/V into its cache (in place) and the tokens attend to it, on `kernels`.

    `attend(i, q, k, v)` is the attention of layer i given its rotated q, k, v; `layer(i)` is
    the same as one layer's `attend`, which also takes the layer's fused q/k/v product as it is
    (`attend_product`: norms, rotary and cache writes in one kernel on a GPU); `cache` is the cache
    as written so far.
    """

    def __init__(
        self,
        cache: KVCache,
        count: Int[Array, " b"],
        t: int,
        mesh: Mesh | None = None,
        kernels: KernelConfig | None = None,
    ):
        self.mesh, self.kernels = mesh, kernels
        j = jnp.arange(t, dtype=jnp.int32)
        self.q_positions = cache.length[:, None] + j
        self.q_segment_ids = (j < count[:, None]).astype(jnp.int32)
        self.slot_BT = cache.slots(count, t)
        self.cache = cache.with_tokens(self.slot_BT, count)

    def attend(self, i: int, q, k, v):
        c = self.cache
        k_i, v_i = write_kv(c.k[i], k, self.slot_BT), write_kv(c.v[i], v, self.slot_BT)
        return self._attend_written(i, q, k_i, v_i)

    def layer(self, i: int) -> LayerWriter:
        """Layer i's `attend`, which also takes its fused q/k/v product as it is."""
        return LayerWriter(self, i)

    def attend_product(self, i: int, qkv, rms_input, norm, cos_sin, *, eps: float):
        """`attend` from layer i's fused q/k/v product [B,T,K,G+2,E] before its scale by 1 /
        RMS(`rms_input`) (if given), norms and rotary: for a few queries a row on an NVIDIA GPU
        they and the cache writes run as one kernel (`qkv_epilogue`), elsewhere as
        `finish_and_write` (a prefill's queries go on to the block kernels, which would transpose
        the kernel's query layout back)."""
        c = self.cache
        args = (qkv, rms_input, norm, cos_sin, self.slot_BT, c.k[i], c.v[i])
        kernels = self.kernels or KernelConfig()
        backend = attention_backend(kernels.decode_backend, qkv.shape[-1])
        if (
            kernels.qkv_kernel
            and backend in ("pallas", "pallas_interpret")
            and qkv.shape[1] <= kernels.few_queries
            and qkv_epilogue.supports(rms_input)
        ):
            interpret = backend == "pallas_interpret"
            finish = functools.partial(qkv_epilogue.kernel, eps=eps, interpret=interpret)
        else:
            finish = functools.partial(finish_and_write, eps=eps)
        q, k_i, v_i = self._sharded(finish, *args)
        return self._attend_written(i, q, k_i, v_i)

    def _attend_written(self, i: int, q, k_i, v_i):
        """q against layer i's cache, its new tokens' K/V written (k_i, v_i)."""
        c = self.cache
        put = lambda layers, x: (*layers[:i], x, *layers[i + 1 :])
        self.cache = c._replace(k=put(c.k, k_i), v=put(c.v, v_i))
        ids = dict(q_segment_ids=self.q_segment_ids, q_positions=self.q_positions)
        return rollout_attention(
            self.mesh, self.kernels, q, k_i, v_i, c.segment_ids, c.positions, **ids
        )

    def _sharded(self, finish, qkv, rms_input, norm, cos_sin, slot, k_cache, v_cache):
        """`finish` (as `finish_and_write`) inside `shard_map` on a mesh of several devices, rows
        and KV heads split as `rollout_attention` splits them."""
        args = (qkv, rms_input, norm, cos_sin, slot, k_cache, v_cache)
        axes = _row_head_axes(self.mesh, qkv.shape[0])
        if axes is None:
            return finish(*args)
        rows, heads, kv = axes
        tokens, cache_spec = P(rows), P(rows, kv, None, None)
        specs = (P(rows, None, kv, None, None), tokens, P(), (tokens, tokens), tokens)
        return jax.shard_map(
            finish,
            mesh=self.mesh,
            in_specs=(*specs, cache_spec, cache_spec),
            out_specs=(P(rows, None, heads, None), cache_spec, cache_spec),
            check_vma=False,
        )(*args)


def _row_head_axes(mesh: Mesh | None, rows: int) -> tuple | None:
    """The mesh axes of rows, query heads and KV heads (`jspec.mesh.RULES`) that a rollout's
    Pallas kernels run split over inside `shard_map` (they have no SPMD partitioning rule, so XLA
    would gather their inputs to every device); None where nothing splits: one device, or rows
    that do not divide their axis."""
    if mesh is None or mesh.size == 1 or rows % mesh_lib.axis_size(mesh, "decode_batch"):
        return None
    return tuple(mesh_lib.RULES[n] for n in ("decode_batch", "act_heads", "act_kv_heads"))


class LayerWriter(NamedTuple):
    """Layer `i` of a `CacheWriter`: called with rotated (q, k, v) as `attend`, or given the
    layer's fused q/k/v product by `layers.attention_sublayer` (`from_product`)."""

    writer: CacheWriter
    i: int

    def __call__(self, q, k, v):
        return self.writer.attend(self.i, q, k, v)

    def from_product(self, qkv, rms_input, norm, cos_sin, *, eps):
        return self.writer.attend_product(self.i, qkv, rms_input, norm, cos_sin, eps=eps)


def finish_and_write(qkv, rms_input, norm, cos_sin, slot, k_cache, v_cache, *, eps: float):
    """q [B,T,H,E] rotated, and the caches with k (rotated) and v written at `slot` [B,T], from a
    fused q/k/v product [B,T,K,G+2,E] of `rms_input` (None: its norm not folded into it):
    `qkv_epilogue.kernel`'s results, by the model's functions (`layers.finish_qkv`,
    `layers.apply_rope`, `write_kv`)."""
    scale = None if rms_input is None else layers.inverse_rms(rms_input, eps)
    q, k, v = layers.finish_qkv(qkv, scale, norm, eps)
    q, k = layers.apply_rope(q, cos_sin), layers.apply_rope(k, cos_sin)
    return q.astype(k_cache.dtype), write_kv(k_cache, k, slot), write_kv(v_cache, v, slot)


def cache_attention(
    cache: KVCache,
    layer: int,
    branch: Branch,
    mesh: Mesh | None = None,
    kernels: KernelConfig | None = None,
):
    """Branch nodes (verification, draft trees) against one layer of the cache, on `kernels`."""
    k, v, seg, pos = cache.k[layer], cache.v[layer], cache.segment_ids, cache.positions
    return rollout_attention(mesh, kernels, None, k, v, seg, pos, branch=branch)[1]


def rollout_attention(
    mesh: Mesh | None, kernels: KernelConfig | None, q, k, v, segment_ids, positions, **kw
):
    """`attention` of rollout queries q [B,T,H,E] (or None, with a `branch`) against a layer's
    cache [B,Hkv,S,E], on `kernels` (None: `KernelConfig()`): up to `kernels.few_queries` queries
    per row the few-query path (`impl="decode"`, its cache part on `kernels.decode_backend`), the
    block kernels beyond. On a mesh of several devices it runs inside `shard_map`, rows and heads
    split as `jspec.mesh.RULES` places them (every row and KV head is independent:
    `_row_head_axes`)."""
    kernels = kernels or KernelConfig()
    queries = (q if q is not None else kw["branch"].q).shape[1]
    impl = "decode" if queries <= kernels.few_queries else "auto"
    options = DecodeOptions(backend=kernels.decode_backend)
    call = lambda q, k, v, seg, pos, kw: attention(
        q, k, v, seg, pos, impl=impl, heads_major=True, decode_options=options, **kw
    )
    axes = _row_head_axes(mesh, k.shape[0])
    if axes is None:
        return call(q, k, v, segment_ids, positions, kw)
    rows, heads, kv = axes
    ids, q_spec, cache_spec = P(rows, None), P(rows, None, heads, None), P(rows, kv, None, None)
    kw_specs = {name: ids for name in kw if name != "branch"}
    if "branch" in kw:
        kw_specs["branch"] = jax.tree.map(
            lambda x: q_spec if x.ndim == 4 else ids, kw["branch"]
        )._replace(k=P(rows, None, kv, None), v=P(rows, None, kv, None))
    specs = (None if q is None else q_spec, cache_spec, cache_spec, ids, ids, kw_specs)
    out_specs = q_spec if "branch" not in kw else (None if q is None else q_spec, q_spec)
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(
        q, k, v, segment_ids, positions, kw
    )


def last_valid(x_BTD: Array, count: Int[Array, " b"]) -> Array:
    """x at each row's last valid token [B,D]; NaN for a row with none."""
    last = jnp.take_along_axis(x_BTD, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    return jnp.where(count[:, None] >= 1, last, jnp.nan)


class TreeKV(NamedTuple):
    """Branch nodes computed at earlier steps of a tree expansion, which later nodes may have as
    ancestors: their K/V per layer, anchors (-1: not filled yet) and parents (indices into these
    C nodes). A fixed capacity C, so one expansion step keeps one shape at every depth."""

    k: Float[Array, "l b c kv e"]
    v: Float[Array, "l b c kv e"]
    anchor: Int[Array, "b c"]
    parent: Int[Array, "b c"]

    @classmethod
    def empty(cls, num_layers, batch, capacity, num_kv_heads, head_dim, dtype) -> TreeKV:
        kv = jnp.zeros((num_layers, batch, capacity, num_kv_heads, head_dim), dtype)
        ids = jnp.full((batch, capacity), -1, jnp.int32)
        return cls(kv, kv, ids, ids)

    def branch(self, i: int, q, k, v, anchor, parent) -> Branch:
        """The `Branch` of N new nodes (q, k, v [B,N,.,E]; `parent` indexes these C nodes followed
        by the N new ones) with the earlier nodes of layer i as possible ancestors."""
        c, n = self.anchor.shape[1], q.shape[1]
        cat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)], axis=1)
        keys, values = cat(self.k[i], k), cat(self.v[i], v)
        anchors, parents = cat(self.anchor, anchor), cat(self.parent, parent)
        query_nodes = jnp.broadcast_to(c + jnp.arange(n, dtype=jnp.int32), anchor.shape)
        return Branch(q, keys, values, anchors, parents, query_nodes=query_nodes)

    def add(self, k: KV, v: KV, anchor, parent, offset) -> TreeKV:
        """Stores N new nodes at indices offset .. offset + N - 1."""
        at = lambda a, x, axis: jax.lax.dynamic_update_slice_in_dim(
            a, x.astype(a.dtype), offset, axis
        )
        kv = (at(self.k, k, 2), at(self.v, v, 2))
        return TreeKV(*kv, at(self.anchor, anchor, 1), at(self.parent, parent, 1))
