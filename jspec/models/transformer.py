"""A decoder-only LM of the Llama 3 / Qwen3 families, in Flax NNX.

One layer body (`Block.__call__`) serves every use; what differs is how it is driven:

- training (`Transformer.__call__`): packed rows, layers scanned (`jax.lax.scan`) under the remat
  policy of `ModelConfig.remat`; with a context axis in the mesh, rows run in the zigzag order of
  the ring and attention is `jspec.attention`'s ring (documents padded to 2 * cp);
- rollout (`prefill`, `decode`, `branch_forward`): layers stepped through in a Python loop that
  indexes the stacked weights, because a scanned stack streams weights 1.7-2.5x slower in decode
  (docs/gpu.md).

Mixture of experts (`jspec.models.moe`): layers with the sparse MLP are stacked apart from those
with the dense MLP (`layer_stacks`), as the two have different weights; training scans each run of
consecutive layers of one kind, rollout steps through the layers in order, from either stack.

Attention itself is `jspec.attention`: this module rotates q and k and hands them over. Decode is
a one-token prefill: the token's K/V are written into the cache, layer by layer in place, and the
token attends to the cache. Verification is the branch forward (nodes hanging off the last cached
token); `KVCache.append` then writes the accepted nodes.

Shape suffixes: B batch, T tokens, N branch nodes, S cache slots, L layers, D hidden, H query heads,
K key/value heads, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention import Branch, attention, zigzag_shard, zigzag_unshard
from jspec.attention.parallel import sharded_ring
from jspec.attention.zigzag import check_alignment, concrete, mark_misaligned
from jspec.config import ConfigError, ModelConfig
from jspec.models.moe import MoE, load_balancing_loss

# Batch and sequence names of activations, in training and in rollout (where the context axis
# serves as extra data parallelism: docs/architecture.md).
TRAIN_ACT = ("batch", "seq")
ROLLOUT_ACT = ("decode_batch", None)

# Rollout queries per row up to which attention takes the few-query path (`impl="decode"`: one read
# of the cache for all queries of a row); longer prefills take the block kernels.
FEW_QUERIES = 64

KV = Float[Array, "l b n kv e"]  # keys or values of N new tokens, every layer
Taps = Float[Array, "taps b t d"]  # hidden states entering the layers config.taps (T may be absent)

# Which config field sizes each logical parameter axis, for the mesh check.
_AXIS_FIELDS = {
    "vocab": "vocab_size",
    "embed": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "mlp": "intermediate_size",
    "layers": "num_layers",
    "expert": "num_experts",
    "moe_mlp": "moe_intermediate_size",
}


def check_mesh(config: ModelConfig, mesh: Mesh | None) -> None:
    """Raises ConfigError if a parameter axis does not divide over the mesh axes it is split on."""
    if mesh is None:
        return
    for name, field in _AXIS_FIELDS.items():
        axes = mesh_lib.RULES.get(name)
        if axes is None:
            continue
        size = mesh_lib.axis_size(mesh, name)
        value = getattr(config, field)
        if value % size:
            axes = (axes,) if isinstance(axes, str) else axes
            mesh_size = " x ".join(f"mesh.{a}" for a in axes)
            raise ConfigError(
                f"model.{field}={value} is not divisible by {size}, the size of {mesh_size} that "
                f"parameter axis {name!r} is split over; set {mesh_size} to a divisor of {value},"
                f" or use a model whose {field} is a multiple of {size}."
            )


def layer_stacks(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The layers each decoder stack holds, by attribute of `Transformer`: `layers` those with the
    dense MLP, `moe_layers` those with the mixture of experts; an empty stack is absent."""
    sparse = config.sparse_layers
    stacks = {
        "layers": tuple(i for i, s in enumerate(sparse) if not s),
        "moe_layers": tuple(i for i, s in enumerate(sparse) if s),
    }
    return {name: ids for name, ids in stacks.items() if ids}


# ---------------------------------------------------------------------------------------------
# Pieces.


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm over the last axis in float32, rounded back before the weight (as Hugging Face)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [E/2] (float32), with Llama-3 frequency-dependent scaling if set."""
    e = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, e, 2, dtype=np.float32) / e))
    s = config.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    wavelen = 2 * np.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(config: ModelConfig, positions: Int[Array, "b t"]) -> tuple[Array, Array]:
    """(cos, sin) [B,T,1,E] for `apply_rope`, computed once per forward for all layers: cos of
    each half's angles, and sin with the first half negated (the sign `rotate_half` gives)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def apply_rope(x_BTHE: Array, cos_sin: tuple[Array, Array]) -> Array:
    """Rotary embedding in the split-half layout of Hugging Face Llama/Qwen (`rotate_half`):
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. The halves are swapped by reversing an axis
    of length 2, an index map that fuses with the arithmetic: on the GPU a concatenate of the
    halves can run as a kernel of its own (`wrapped_concatenate`) in every layer."""
    cos, sin = cos_sin
    x = x_BTHE.astype(jnp.float32)
    swapped = jnp.flip(x.reshape(*x.shape[:-1], 2, -1), axis=-2).reshape(x.shape)  # [x2, x1]
    return (x * cos + swapped * sin).astype(x_BTHE.dtype)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, fan_in: int | None) -> nnx.Param:
    """A parameter with its logical axis names; fan_in None means ones (a norm weight)."""
    if fan_in is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)
    return nnx.Param(value, axes=axes)


# ---------------------------------------------------------------------------------------------
# The layer.


class Block(nnx.Module):
    """Decoder layers: one Block holds the weights of `num_layers` layers stacked on axis 0, with
    the dense MLP, or with the mixture of experts if `sparse` (`mesh`: its expert parallelism).

    `__call__` is the body of one layer and runs on a one-layer slice of the weights (as merged
    by `Transformer._scan` and `Transformer._unrolled`); the stacked module is never called.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        sparse: bool = False,
        mesh: Mesh | None = None,
    ):
        c, n = config, num_layers
        d, h, k, e, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        p = functools.partial(_param, rngs, dtype=jnp.dtype(c.param_dtype))
        self.config = config
        self.attn_norm = p((n, d), ("layers", "norm"), fan_in=None)
        self.wq = p((n, d, h, e), ("layers", "embed", "heads", "head_dim"), fan_in=d)
        self.wk = p((n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), fan_in=d)
        self.wv = p((n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), fan_in=d)
        self.wo = p((n, h, e, d), ("layers", "heads", "head_dim", "embed"), fan_in=h * e)
        self.q_norm = p((n, e), ("layers", "norm"), fan_in=None) if c.qk_norm else None
        self.k_norm = p((n, e), ("layers", "norm"), fan_in=None) if c.qk_norm else None
        self.mlp_norm = p((n, d), ("layers", "norm"), fan_in=None)
        self.moe = MoE(config, n, p, mesh) if sparse else None
        if not sparse:
            self.w_gate = p((n, d, f), ("layers", "embed", "mlp"), fan_in=d)
            self.w_up = p((n, d, f), ("layers", "embed", "mlp"), fan_in=d)
            self.w_down = p((n, f, d), ("layers", "mlp", "embed"), fan_in=f)
        # Set by `fused` (rollouts) in place of wq, wk, wv and of w_gate, w_up.
        self.w_qkv, self.w_gate_up = nnx.data(None), nnx.data(None)

    def __call__(self, x_BTD, cos_sin, attend, act, valid_BT=None):
        """One layer. `attend(q, k, v) -> out` is the attention of the caller's mode (rotated q, k);
        `act` names the activations' (batch, seq) axes and `valid_BT` marks non-padding tokens,
        for the mixture of experts (its token exchange and router statistics).

        Returns the new residual stream, this layer's (k, v) [B,T,K,E], rotated, for caches, and
        the router's `RouterStats` (None for a dense MLP).
        """
        c = self.config
        w = lambda p: None if p is None else p[...].astype(jnp.dtype(c.dtype))
        fused = self.w_qkv is not None
        h_BTD = rms_norm(x_BTD, self.attn_norm[...], c.rms_norm_eps)
        o_BTD, kv = attention_sublayer(
            h_BTD, w(self.w_qkv) if fused else (w(self.wq), w(self.wk), w(self.wv)), w(self.wo),
            cos_sin, attend, q_norm=w(self.q_norm), k_norm=w(self.k_norm), eps=c.rms_norm_eps,
        )  # fmt: skip
        x_BTD = x_BTD + o_BTD
        h_BTD = rms_norm(x_BTD, self.mlp_norm[...], c.rms_norm_eps)
        if self.moe is not None:
            y_BTD, stats = self.moe(h_BTD, valid_BT, act)
            return x_BTD + y_BTD, kv, stats
        w_in = w(self.w_gate_up) if fused else (w(self.w_gate), w(self.w_up))
        return x_BTD + swiglu(h_BTD, w_in, w(self.w_down)), kv, None

    def fused(self, constrain) -> Block:
        """A copy of this one-layer block (a slice of the stacks) with its input products fused,
        for the rollout loop: q, k and v as one matrix [D, K, G+2, E] (each KV head's G query
        heads, then its k and v, so a mesh that splits the KV heads keeps every group whole), and
        gate and up as one [D, 2, F]. A decode step reads the same bytes in two matrix products
        instead of five: at batch 1 on the GPU, small products such as k and v ran far below the
        memory bandwidth, while plain XLA with fused matrices streams the Qwen3-8B weights at 97%
        of it. `constrain(x, logical axis names)` places the fused weights on a mesh, as the
        unfused ones are (a KV head's group, a slice of the MLP width, on one device)."""
        return fuse_products(nnx.merge(*nnx.split(self)), constrain, mlp=self.moe is None)


def fuse_products(layer, constrain, *, mlp: bool = True, input_axis: str | None = "embed"):
    """`layer` (a copy, changed in place) with wq, wk, wv replaced by w_qkv [D, K, G+2, E] (each KV
    head's G query heads, then its k and v; `project_qkv` reads it) and, with `mlp`, w_gate and
    w_up by w_gate_up [D, 2, F] (`swiglu` reads it). `constrain(x, logical axis names)` places
    them; `input_axis` names the q/k/v products' input axis."""
    wq_DHE, wk_DKE, wv_DKE = layer.wq[...], layer.wk[...], layer.wv[...]
    d, h, e = wq_DHE.shape
    k = wk_DKE.shape[1]
    q_DKGE = wq_DHE.reshape(d, k, h // k, e)
    qkv = jnp.concatenate([q_DKGE, wk_DKE[:, :, None], wv_DKE[:, :, None]], axis=2)
    layer.w_qkv = nnx.Param(constrain(qkv, (input_axis, "kv_heads", None, "head_dim")))
    layer.wq = layer.wk = layer.wv = None
    if mlp:
        gate_up = jnp.stack([layer.w_gate[...], layer.w_up[...]], axis=1)
        layer.w_gate_up = nnx.Param(constrain(gate_up, ("embed", None, "mlp")))
        layer.w_gate = layer.w_up = None
    return layer


def attention_sublayer(h_BTD, w_qkv, wo, cos_sin, attend, *, q_norm=None, k_norm=None, eps):
    """Projections (`w_qkv`: see `project_qkv`), optional q/k RMSNorm (Qwen3), rotary, `attend`,
    output projection.

    Shared by the decoder layer and the EAGLE-3 draft layer (whose input is 2H wide). Returns the
    attention output [B,T,D] and the rotated (k, v) [B,T,K,E] for caches.
    """
    q_BTHE, k_BTKE, v_BTKE = project_qkv(h_BTD, w_qkv)
    if q_norm is not None:
        q_BTHE = rms_norm(q_BTHE, q_norm, eps)
        k_BTKE = rms_norm(k_BTKE, k_norm, eps)
    q_BTHE, k_BTKE = apply_rope(q_BTHE, cos_sin), apply_rope(k_BTKE, cos_sin)
    o_BTHE = attend(q_BTHE, k_BTKE, v_BTKE)
    return jnp.einsum("bthe,hed->btd", o_BTHE, wo), (k_BTKE, v_BTKE)


def project_qkv(h_BTD, w_qkv):
    """q [B,T,H,E], k and v [B,T,K,E] of h: `w_qkv` is (wq [D,H,E], wk, wv [D,K,E]), or the three
    fused [D, K, G+2, E] (`Block.fused`), query head h = KV head h // G."""
    if isinstance(w_qkv, tuple):
        wq, wk, wv = w_qkv
        q_BTHE = jnp.einsum("btd,dhe->bthe", h_BTD, wq)
        return q_BTHE, *(jnp.einsum("btd,dke->btke", h_BTD, w) for w in (wk, wv))
    qkv = jnp.einsum("btd,dkne->btkne", h_BTD, w_qkv)
    b, t, k, n, e = qkv.shape
    return qkv[:, :, :, : n - 2].reshape(b, t, k * (n - 2), e), qkv[:, :, :, -2], qkv[:, :, :, -1]


def swiglu(h_BTD, w_in, w_down):
    """The SwiGLU MLP of Llama and Qwen; `w_in` is (w_gate, w_up) [D,F], or the two stacked
    [D, 2, F] (`Block.fused`)."""
    if isinstance(w_in, tuple):
        g_BTF, u_BTF = (jnp.einsum("btd,df->btf", h_BTD, w) for w in w_in)
    else:
        gu = jnp.einsum("btd,dcf->btcf", h_BTD, w_in)
        g_BTF, u_BTF = gu[:, :, 0], gu[:, :, 1]
    return jnp.einsum("btf,fd->btd", jax.nn.silu(g_BTF) * u_BTF, w_down)


def remat_layer(body, remat: str, static_argnums=()):
    """`body` (one layer of a scan) under `ModelConfig.remat`: 'full' saves only its inputs,
    'dots' also the weight matmuls, 'none' everything."""
    if remat == "none":
        return body
    policy = None if remat == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(body, prevent_cse=False, policy=policy, static_argnums=static_argnums)


# ---------------------------------------------------------------------------------------------
# The KV cache.


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
        """Where the first `count[b]` of n new tokens of row b go (the slot count `s` = dropped).

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
        return jnp.where(j < count[:, None], self.length[:, None] + j, s)

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
    place under `jit` when the cache is donated or carried). Slots past the end are dropped."""
    rows = jnp.arange(slot_BN.shape[0])[:, None, None]
    heads = jnp.arange(cache_kv.shape[1])[None, :, None]
    new = jnp.swapaxes(new_kv, 1, 2).astype(cache_kv.dtype)  # [B, K, N, E]
    return cache_kv.at[rows, heads, slot_BN[:, None, :]].set(new, mode="drop")


class CacheWriter:
    """Attention of T new tokens per row that continue the cache's documents: each layer writes the
    tokens' K/V into its cache (in place) and the tokens attend to it.

    `attend(i, q, k, v)` is the attention of layer i; `cache` is the cache as written so far.
    """

    def __init__(self, cache: KVCache, count: Int[Array, " b"], t: int, mesh: Mesh | None = None):
        self.mesh = mesh
        j = jnp.arange(t, dtype=jnp.int32)
        self.q_positions = cache.length[:, None] + j
        self.q_segment_ids = (j < count[:, None]).astype(jnp.int32)
        self.slot_BT = cache.slots(count, t)
        self.cache = cache.with_tokens(self.slot_BT, count)

    def attend(self, i: int, q, k, v):
        c = self.cache
        k_i, v_i = write_kv(c.k[i], k, self.slot_BT), write_kv(c.v[i], v, self.slot_BT)
        put = lambda layers, x: (*layers[:i], x, *layers[i + 1 :])
        self.cache = c._replace(k=put(c.k, k_i), v=put(c.v, v_i))
        ids = dict(q_segment_ids=self.q_segment_ids, q_positions=self.q_positions)
        return rollout_attention(self.mesh, q, k_i, v_i, c.segment_ids, c.positions, **ids)


def rollout_impl(queries: int) -> str:
    """The attention path of rollout queries: few per row take `impl="decode"`."""
    return "decode" if queries <= FEW_QUERIES else "auto"


def cache_attention(cache: KVCache, layer: int, branch: Branch, mesh: Mesh | None = None):
    """Branch nodes (verification, draft trees) against one layer of the cache."""
    k, v, seg, pos = cache.k[layer], cache.v[layer], cache.segment_ids, cache.positions
    return rollout_attention(mesh, None, k, v, seg, pos, branch=branch)[1]


def rollout_attention(mesh: Mesh | None, q, k, v, segment_ids, positions, **kw):
    """`attention` of rollout queries q [B,T,H,E] (or None, with a `branch`) against a layer's
    cache [B,Hkv,S,E]. On a mesh of several devices it runs inside `shard_map`, rows and heads
    split as `jspec.mesh.RULES` places them (every row and KV head is independent): a Pallas
    kernel has no SPMD partitioning rule, so XLA would gather its inputs to every device."""
    queries = (q if q is not None else kw["branch"].q).shape[1]
    call = lambda q, k, v, seg, pos, kw: attention(
        q, k, v, seg, pos, impl=rollout_impl(queries), heads_major=True, **kw
    )
    if mesh is None or mesh.size == 1 or k.shape[0] % mesh_lib.axis_size(mesh, "decode_batch"):
        return call(q, k, v, segment_ids, positions, kw)  # (rows that do not split: unsharded)
    rows, heads, kv = (mesh_lib.RULES[n] for n in ("decode_batch", "act_heads", "act_kv_heads"))
    ids, q_spec = P(rows, None), P(rows, None, heads, None)
    kw_specs = {name: ids for name in kw if name != "branch"}
    if "branch" in kw:
        kw_specs["branch"] = jax.tree.map(
            lambda x: q_spec if x.ndim == 4 else ids, kw["branch"]
        )._replace(k=P(rows, None, kv, None), v=P(rows, None, kv, None))
    specs = (None if q is None else q_spec, P(rows, kv, None, None), P(rows, kv, None, None), ids,
             ids, kw_specs)  # fmt: skip
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
        return Branch(
            q, cat(self.k[i], k), cat(self.v[i], v), cat(self.anchor, anchor),
            cat(self.parent, parent),
            query_nodes=jnp.broadcast_to(c + jnp.arange(n, dtype=jnp.int32), anchor.shape),
        )  # fmt: skip

    def add(self, k: KV, v: KV, anchor, parent, offset) -> TreeKV:
        """Stores N new nodes at indices offset .. offset + N - 1."""
        at = lambda a, x, axis: jax.lax.dynamic_update_slice_in_dim(
            a, x.astype(a.dtype), offset, axis
        )
        kv = (at(self.k, k, 2), at(self.v, v, 2))
        return TreeKV(*kv, at(self.anchor, anchor, 1), at(self.parent, parent, 1))


# ---------------------------------------------------------------------------------------------
# The model.


def rollout_weights(weights, dtype):
    """`weights` (a pytree) with each floating-point array cast to the compute `dtype`, behind an
    optimization barrier: a copy made once before a loop of rollout steps, which XLA would
    otherwise fuse back into the loop and redo at every step. Every weight is cast to the compute
    dtype where it is used, so the copy computes exactly what the weights do."""
    dtype = jnp.dtype(dtype)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.lax.optimization_barrier(jax.tree.map(cast, weights))


class Transformer(nnx.Module):
    """Decoder-only LM. Parameters carry logical axis names (`param_shardings` places them).

    `mesh` (static) is used for activation sharding constraints and expert parallelism; None means
    neither. The decoder layers are `layers` and `moe_layers` (`layer_stacks`; None when empty).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        config.validate()
        check_mesh(config, mesh)
        c, pdt = config, jnp.dtype(config.param_dtype)
        self.config = config
        self.mesh = mesh
        vd = (c.vocab_size, c.hidden_size)
        self.embed = _param(rngs, vd, ("vocab", "embed"), pdt, c.hidden_size)
        stacks = layer_stacks(config)
        dense, sparse = stacks.get("layers"), stacks.get("moe_layers")
        self.layers = Block(config, len(dense), rngs=rngs) if dense else None
        self.moe_layers = (
            Block(config, len(sparse), rngs=rngs, sparse=True, mesh=mesh) if sparse else None
        )
        self.final_norm = _param(rngs, (c.hidden_size,), ("norm",), pdt, None)
        tied = c.tie_embeddings
        self.unembed = None if tied else _param(rngs, vd, ("vocab", "embed"), pdt, c.hidden_size)
        self.unstacked = nnx.data(None)  # set by `for_rollout`

    # -- training ------------------------------------------------------------------------------

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        segment_ids: Int[Array, "b t"] | None = None,
        positions: Int[Array, "b t"] | None = None,
        *,
        taps: bool = False,
        aux_loss: bool = False,
    ) -> Float[Array, "b t v"] | tuple[Array, ...]:
        """Logits (float32) of packed rows; with `taps`, also the hidden states entering the layers
        `config.taps` [len(taps),B,T,D] (not detached: the caller stops their gradient); with
        `aux_loss`, last, the router's load-balancing loss over the non-padding tokens (a scalar,
        `transformers`' `aux_loss`; 0 without sparse layers): a training loss adds
        `config.router_aux_loss_coef` times it.

        segment_ids None: one document per row; positions None: 0..T-1 in every row (pass them
        for packed rows, restarting at each document).
        """
        b, t = tokens.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        natural_seg, cp = segment_ids, self._context_size()
        if cp > 1:
            # The whole forward runs in the ring's zigzag row order: only attention cares about
            # token order, so the rows are permuted once here and once at the output.
            check_alignment(segment_ids, cp)
            tokens, segment_ids, positions = (
                zigzag_shard(x, natural_seg, cp) for x in (tokens, segment_ids, positions)
            )
            ring = sharded_ring(
                self.mesh, mesh_lib.RULES["seq"], batch_axis=mesh_lib.RULES["batch"],
                head_axis=mesh_lib.RULES["act_heads"],
            )  # fmt: skip
            attend = lambda q, k, v, seg, pos: ring(q, k, v, seg, pos, None)[0]
        else:
            attend = attention
        x_BTD = self._embed(tokens, TRAIN_ACT)
        cos_sin = rope_angles(self.config, positions)
        x_BTD, taps_, stats = self._scan(x_BTD, cos_sin, attend, segment_ids, positions, taps)
        if cp > 1:
            # Back to natural order before the LM head: the permutation depends on the documents,
            # so each device gathers what it permutes; the hidden states are D wide, the logits V.
            # A misaligned document (known only under jit) marks its row with NaN.
            natural = lambda x: self._constrain(
                zigzag_unshard(x, natural_seg, cp), (*TRAIN_ACT, "act_embed")
            )
            x_BTD = natural(mark_misaligned(x_BTD, natural_seg, cp))
            taps_ = [natural(x) for x in taps_]
        logits = self._logits(x_BTD, TRAIN_ACT)
        out = (logits, *([jnp.stack(taps_)] if taps else []))
        if aux_loss:
            out += (jnp.zeros(()) if stats is None else load_balancing_loss(stats),)
        return out if len(out) > 1 else logits

    # -- rollout -------------------------------------------------------------------------------

    def for_rollout(self) -> Transformer:
        """This model with each decoder layer in weights of its own (`unstacked`, products fused:
        `Block.fused`), all weights in the compute dtype, for a loop of rollout steps; `self` is
        unchanged.

        The rollout path otherwise slices layer i out of the stacked weights, and inside a loop
        XLA (on GPU) copies every slice at every step, which doubles the bytes a decode step
        reads; float32 weights (an RL policy's) would be cast to the compute dtype at every step
        too, reading each byte three times. Here both happen once (`rollout_weights`); the
        weights are held twice while the copy lives.
        """
        model = nnx.merge(*nnx.split(self))
        layers = [layer.fused(self._constrain) for layer in self._layers()]
        graphdefs, states = zip(*map(nnx.split, layers), strict=True)
        own = [n for n in ("embed", "final_norm", "unembed") if getattr(self, n) is not None]
        states, values = rollout_weights(
            (list(states), [getattr(self, n)[...] for n in own]), self.config.dtype
        )
        model.unstacked = nnx.List(map(nnx.merge, graphdefs, states))
        for name, value in zip(own, values, strict=True):  # new Variables: the copy's are `self`'s
            variable = getattr(self, name)
            setattr(model, name, type(variable)(value, **variable.get_metadata()))
        return model

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache of `max_len` slots per row (at most `config.max_seq_len`)."""
        c = self.config
        if max_len > c.max_seq_len:
            raise ConfigError(
                f"a cache of {max_len} slots exceeds model.max_seq_len={c.max_seq_len}; ask for "
                "fewer tokens, or raise model.max_seq_len if the model was trained for more."
            )
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        bs = ROLLOUT_ACT[0]
        zeros = lambda: self._constrain(
            jnp.zeros(shape, jnp.dtype(c.dtype)), (bs, "act_kv_heads", None, None)
        )
        kv = lambda: tuple(zeros() for _ in range(c.num_layers))
        ids = lambda: self._constrain(jnp.zeros((batch, max_len), jnp.int32), (bs, None))
        length = self._constrain(jnp.zeros((batch,), jnp.int32), (bs,))
        return KVCache(kv(), kv(), ids(), ids(), length, jnp.zeros((batch,), bool))

    def prefill(
        self,
        tokens: Int[Array, "b t"],
        cache: KVCache,
        lengths: Int[Array, " b"] | None = None,
        *,
        taps: bool = False,
    ) -> tuple[Float[Array, "b v"], KVCache] | tuple[Float[Array, "b v"], KVCache, Taps]:
        """Runs right-padded tokens (row b: the first `lengths[b]`; None: all T) into the cache,
        continuing each row's document at position `cache.length[b]` (0 for a new cache).

        Returns the logits after each row's last new token, the cache with the tokens written and,
        with `taps`, the tap hidden states of every new token [len(taps),B,T,D]. A row given no new
        token has no such logits: that is an error for concrete lengths, and NaN logits under `jit`.
        """
        b, t = tokens.shape
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        if concrete(lengths) and not np.all(np.asarray(lengths) >= 1):
            r = int(np.flatnonzero(np.asarray(lengths) < 1)[0])
            raise ValueError(
                f"lengths[{r}]={int(lengths[r])}: every row needs at least one new token (a row "
                "with none has no logits to return); drop the row or give it a token."
            )
        writer = CacheWriter(cache, lengths, t, self.mesh)
        x_BTD = self._embed(tokens, ROLLOUT_ACT)
        cos_sin = rope_angles(self.config, writer.q_positions)
        x_BTD, taps_, _ = self._unrolled(x_BTD, cos_sin, writer.attend, taps)
        logits = self._logits(last_valid(x_BTD, lengths)[:, None], ROLLOUT_ACT)[:, 0]
        return (logits, writer.cache, jnp.stack(taps_)) if taps else (logits, writer.cache)

    def decode(
        self, token: Int[Array, " b"], cache: KVCache, *, taps: bool = False
    ) -> tuple[Float[Array, "b v"], KVCache] | tuple[Float[Array, "b v"], KVCache, Taps]:
        """One token per row at position `cache.length`: logits [B,V], the cache with the token
        appended, and with `taps` the tap hidden states [len(taps),B,D]."""
        out = self.prefill(token[:, None], cache, taps=taps)
        return (*out[:2], out[2][:, :, 0]) if taps else out

    def branch_forward(
        self,
        cache: KVCache,
        tokens: Int[Array, "b n"],
        positions: Int[Array, "b n"],
        anchor: Int[Array, "b n"],
        parent: Int[Array, "b n"],
        *,
        taps: bool = False,
        earlier: TreeKV | None = None,
    ) -> tuple[Float[Array, "b n v"], KV, KV] | tuple[Float[Array, "b n v"], KV, KV, Taps]:
        """Branch tokens against the cache (the verify pass of speculative decoding).

        Node i of row b is token `tokens[b, i]` at `positions[b, i]` (the root's position + depth),
        hanging off cache slot `anchor[b, i]` (-1: padding node) below node `parent[b, i]` (-1:
        none); it sees the cache up to its anchor and its ancestors. With `earlier` (nodes of
        earlier steps of a tree expansion), parents index those C nodes followed by these N.
        Negative tokens are allowed for padding nodes. Returns logits [B,N,V], the nodes' K and V
        [L,B,N,K,E] (for `KVCache.append` of the accepted ones, or `TreeKV.add`) and, with `taps`,
        their tap states [len(taps),B,N,D]. The cache is not changed.
        """

        def attend(i, q, k, v):
            if earlier is None:
                branch = Branch(q, k, v, anchor, parent)
            else:
                branch = earlier.branch(i, q, k, v, anchor, parent)
            return cache_attention(cache, i, branch, self.mesh)

        x_BND = self._embed(tokens, ROLLOUT_ACT)
        x_BND, taps_, (k, v) = self._unrolled(
            x_BND, rope_angles(self.config, positions), attend, taps
        )
        logits = self._logits(x_BND, ROLLOUT_ACT)
        return (logits, k, v, jnp.stack(taps_)) if taps else (logits, k, v)

    # -- internals -----------------------------------------------------------------------------

    def _context_size(self) -> int:
        """Ranks of the ring axis (1: no context parallelism)."""
        axis = mesh_lib.RULES["seq"]
        return 1 if self.mesh is None or axis is None else self.mesh.shape[axis]

    def _constrain(self, x, names):
        return mesh_lib.constrain(x, self.mesh, names)

    def _embed(self, tokens, act):
        table = self.embed[...].astype(jnp.dtype(self.config.dtype))
        x = jnp.take(table, tokens, axis=0, mode="clip")  # clip: padding tokens may be negative
        return self._constrain(x, (*act, "act_embed"))

    def _logits(self, x_BTD, act):
        c = self.config
        x_BTD = rms_norm(x_BTD, self.final_norm[...], c.rms_norm_eps)
        w_VD = (self.embed if self.unembed is None else self.unembed)[...].astype(x_BTD.dtype)
        logits = jnp.einsum("btd,vd->btv", x_BTD, w_VD, preferred_element_type=jnp.float32)
        return self._constrain(logits, (*act, "act_vocab"))

    def _stacks(self) -> dict[str, tuple[nnx.GraphDef, nnx.State]]:
        return {name: nnx.split(getattr(self, name)) for name in layer_stacks(self.config)}

    def _runs(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Layers start..stop-1 as runs (stack, first, end) of consecutive layers of one stack."""
        where = {i: (name, j) for name, ids in layer_stacks(self.config).items()
                 for j, i in enumerate(ids)}  # fmt: skip
        runs: list[tuple[str, int, int]] = []
        for i in range(start, stop):
            name, j = where[i]
            if runs and runs[-1][0] == name and runs[-1][2] == j:
                runs[-1] = (name, runs[-1][1], j + 1)
            else:
                runs.append((name, j, j + 1))
        return runs

    def _scan(self, x_BTD, cos_sin, attend, segment_ids, positions, taps: bool):
        """All layers by `lax.scan` under the remat policy, one scan per run of layers of one stack,
        cut where a tap is taken; `attend(q, k, v, segment_ids, positions)` is the training
        attention (the pipelined model, `jspec.pipeline`, calls it per microbatch). Returns the
        output, the taps and the summed `RouterStats` (None without sparse layers)."""
        stacks = self._stacks()
        layer_attend = lambda q, k, v: attend(q, k, v, segment_ids, positions)
        valid_BT = segment_ids != 0

        def body(graphdef, x, state_i):
            x = self._constrain(x, (*TRAIN_ACT, "act_embed"))
            layer = nnx.merge(graphdef, state_i)
            x, _, stats = layer(x, cos_sin, layer_attend, TRAIN_ACT, valid_BT)
            return x, stats

        body = remat_layer(body, self.config.remat, static_argnums=(0,))
        cuts = sorted(self.config.taps) if taps else []
        entering, start, stats = {}, 0, []
        for stop in [*cuts, self.config.num_layers]:
            for name, lo, hi in self._runs(start, stop):
                graphdef, state = stacks[name]
                part = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], state)
                x_BTD, ys = jax.lax.scan(functools.partial(body, graphdef), x_BTD, part)
                if ys is not None:
                    stats.append(jax.tree.map(lambda y: jnp.sum(y, axis=0), ys))
            entering[stop], start = x_BTD, stop
        total = jax.tree.map(lambda *y: sum(y), *stats) if stats else None
        return x_BTD, [entering[t] for t in self.config.taps] if taps else [], total

    def _layers(self) -> list[Block]:
        """Every decoder layer in order, as static slices of the stacks (`_stacks`)."""
        stacks, layers = self._stacks(), []
        for i in range(self.config.num_layers):
            ((name, j, _),) = self._runs(i, i + 1)
            graphdef, state = stacks[name]
            layers.append(nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state)))
        return layers

    def _unrolled(self, x_BTD, cos_sin, attend, taps: bool):
        """All layers by a Python loop (decode-speed weight streaming); collects every layer's K/V.

        `attend(i, q, k, v)` gets the layer index, to read layer i of a cache.
        """
        entering, ks, vs = {}, [], []
        layers = self._layers() if self.unstacked is None else self.unstacked
        for i, layer in enumerate(layers):
            x_BTD = entering[i] = self._constrain(x_BTD, (*ROLLOUT_ACT, "act_embed"))
            x_BTD, (k, v), _ = layer(x_BTD, cos_sin, functools.partial(attend, i), ROLLOUT_ACT)
            ks.append(k)
            vs.append(v)
        tapped = [entering[t] for t in self.config.taps] if taps else []
        return x_BTD, tapped, (jnp.stack(ks), jnp.stack(vs))


# ---------------------------------------------------------------------------------------------
# Placement.


def param_shardings(model_or_state: nnx.Module | nnx.State, mesh: Mesh) -> nnx.State:
    """NamedShardings of every parameter, by its logical axes and `jspec.mesh.RULES`.

    The result is a tree prefix of `nnx.state(model)`: use it with `jax.device_put(state, ...)`
    or as `out_shardings` of a jitted init.
    """
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state)
    return jax.tree.map(
        lambda var: mesh_lib.sharding(mesh, var.axes),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def create(config: ModelConfig, *, mesh: Mesh | None = None, seed: int = 0) -> Transformer:
    """A randomly initialised Transformer whose parameters are born sharded over `mesh`.

    Initialisation runs under `jit` with the parameters' shardings as outputs, so no device ever
    holds the whole model, and the values do not depend on the mesh.
    """
    return create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh), mesh)


def create_sharded(make, mesh: Mesh | None):
    """The module `make()` builds, initialised under `jit` straight into its parameters'
    shardings over `mesh` (None: default placement)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    out = None if mesh is None else param_shardings(abstract, mesh)
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make()), out_shardings=out)())
