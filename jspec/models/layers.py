"""The pieces of a decoder layer, shared by the decoder (`jspec.models.transformer`) and the
EAGLE-3 draft (`jspec.models.draft`): parameters with logical axis names, RMSNorm, rotary
embeddings, the attention sublayer, the SwiGLU MLP, a layer's rematerialisation, and what
rollouts change in them (the input products fused, the input norms folded into them, the weights
cast once before a loop of steps).

Shape suffixes: B batch, T tokens, D hidden, H query heads, K key/value heads, G query heads per KV
head, E head dim, F MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jspec.attention import SAVED as SAVED_ATTENTION
from jspec.config import ModelConfig


def init_param(rngs: nnx.Rngs | None, shape, axes, dtype, fan_in: int | None) -> nnx.Param:
    """A parameter with its logical axis names; fan_in None means ones (a norm weight)."""
    if fan_in is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)
    return nnx.Param(value, axes=axes)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm over the last axis in float32, rounded back before the weight (as Hugging Face)."""
    y = x.astype(jnp.float32) * inverse_rms(x, eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def inverse_rms(x: Array, eps: float) -> Float[Array, "... 1"]:
    """1 / RMS(x) over the last axis, in float32 (RMSNorm's scale of each vector)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def scaled(y: Array, scale: Array | None) -> Array:
    """y [B, T, ...] times a per-token `scale` [B, T, 1] (None: y), in y's dtype."""
    if scale is None:
        return y
    return (y * scale.reshape(*scale.shape[:2], *(1,) * (y.ndim - 2))).astype(y.dtype)


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


def fuse_products(layer, constrain, *, mlp: bool = True, input_axis: str | None = "embed"):
    """`layer` (a copy, changed in place) in the rollout's layout, every weight stored outputs
    first: wq, wk, wv replaced by w_qkv [K, G+2, E, D] (each KV head's G query heads, then its k
    and v; `project_qkv` reads it), wo as [D, H, E]; with `mlp`, w_gate and w_up by w_gate_up
    [2, F, D] and w_down as [D, F] (`swiglu` reads them); Qwen3's q_norm and k_norm by one
    q_norm [G+2, E] and k_norm None (`finish_qkv` says why). Two products instead of five, and
    for a matrix-vector product (a decode step at batch 1) one kernel that reduces each output's
    contiguous row: with its inputs first, XLA's GPU compiler writes a small weight times its
    input to memory before reducing it, a second weight's worth of traffic. `constrain(x,
    logical axis names)` places the weights; `input_axis` names the q/k/v products' input axis."""
    wq_DHE, wk_DKE, wv_DKE = layer.wq[...], layer.wk[...], layer.wv[...]
    d, h, e = wq_DHE.shape
    k = wk_DKE.shape[1]
    q_DKGE = wq_DHE.reshape(d, k, h // k, e)
    qkv = jnp.concatenate([q_DKGE, wk_DKE[:, :, None], wv_DKE[:, :, None]], axis=2)
    qkv_KNED = jnp.transpose(qkv, (1, 2, 3, 0))
    layer.w_qkv = nnx.Param(constrain(qkv_KNED, ("kv_heads", None, "head_dim", input_axis)))
    layer.wq = layer.wk = layer.wv = None
    if getattr(layer, "k_norm", None) is not None:  # Qwen3's q and k norms as one (`finish_qkv`)
        q_norm, k_norm = layer.q_norm[...], layer.k_norm[...]
        rows = [jnp.broadcast_to(q_norm, (h // k, e)), k_norm[None], jnp.ones((1, e), k_norm.dtype)]
        qkv_norm = constrain(jnp.concatenate(rows), (None, "norm"))
        layer.q_norm, layer.k_norm = nnx.Param(qkv_norm), None
    wo_DHE = jnp.transpose(layer.wo[...], (2, 0, 1))
    layer.wo = nnx.Param(constrain(wo_DHE, ("embed", "heads", "head_dim")))
    if mlp:
        gate_up_CFD = jnp.stack([layer.w_gate[...].T, layer.w_up[...].T])
        layer.w_gate_up = nnx.Param(constrain(gate_up_CFD, (None, "mlp", "embed")))
        layer.w_gate = layer.w_up = None
        layer.w_down = nnx.Param(constrain(layer.w_down[...].T, ("embed", "mlp")))
    return layer


def attention_sublayer(
    h_BTD, w_qkv, wo, cos_sin, attend, *, q_norm=None, k_norm=None, eps, input_scale=None
):
    """Projections (`w_qkv`: see `project_qkv`) times `input_scale` [B,T,1] if given (an input
    norm folded into them: `fold_input_norms`; it is then `inverse_rms(h, eps)`, with the eps of
    the q/k norms, the model's one), optional q/k RMSNorm (Qwen3), rotary, `attend`,
    output projection (`wo` [H,E,D], or [D,H,E] beside a fused `w_qkv`: `fuse_products`).

    Shared by the decoder layer and the EAGLE-3 draft layer (whose input is 2H wide). Returns the
    attention output [B,T,D] and the rotated (k, v) [B,T,K,E] for caches. An `attend` with a
    `from_product` method (`cache.LayerWriter`) takes a fused product's output as it is, with
    what finishes it: h where `input_scale` is given (the kernel takes its RMS itself), the
    joint norm, `cos_sin` and eps; (k, v) is then None: it writes them into its cache itself.
    """
    out = "bthe,hed->btd" if isinstance(w_qkv, tuple) else "bthe,dhe->btd"
    from_product = getattr(attend, "from_product", None)
    if from_product is not None and not isinstance(w_qkv, tuple):
        rms_input = None if input_scale is None else h_BTD  # input_scale = inverse_rms(h, eps)
        qkv = fused_product(h_BTD, w_qkv, k_norm)
        o_BTHE = from_product(qkv, rms_input, q_norm, cos_sin, eps=eps)
        return jnp.einsum(out, o_BTHE, wo), None
    norms = (q_norm, k_norm, eps)
    q_BTHE, k_BTKE, v_BTKE = project_qkv(h_BTD, w_qkv, input_scale, norms)
    q_BTHE, k_BTKE = apply_rope(q_BTHE, cos_sin), apply_rope(k_BTKE, cos_sin)
    o_BTHE = attend(q_BTHE, k_BTKE, v_BTKE)
    return jnp.einsum(out, o_BTHE, wo), (k_BTKE, v_BTKE)


def project_qkv(h_BTD, w_qkv, input_scale=None, norms=(None, None, None)):
    """q [B,T,H,E], k and v [B,T,K,E] of h: `w_qkv` is (wq [D,H,E], wk, wv [D,K,E]), or the three
    fused [K, G+2, E, D] (`fuse_products`), query head h = KV head h // G; times `input_scale`
    [B,T,1] if given. `norms` (q_norm, k_norm, eps): with Qwen3's norms, q and k RMS-normed per
    head (in the fused layout by `finish_qkv`)."""
    q_norm, k_norm, eps = norms
    if isinstance(w_qkv, tuple):
        wq, wk, wv = w_qkv
        q_BTHE = scaled(jnp.einsum("btd,dhe->bthe", h_BTD, wq), input_scale)
        k_BTKE, v_BTKE = (
            scaled(jnp.einsum("btd,dke->btke", h_BTD, w), input_scale) for w in (wk, wv)
        )
        if q_norm is not None:
            q_BTHE, k_BTKE = rms_norm(q_BTHE, q_norm, eps), rms_norm(k_BTKE, k_norm, eps)
        return q_BTHE, k_BTKE, v_BTKE
    return finish_qkv(fused_product(h_BTD, w_qkv, k_norm), input_scale, q_norm, eps)


def fused_product(h_BTD, w_qkv_KNED, k_norm=None) -> Array:
    """The fused q/k/v product [B,T,K,G+2,E] (`fuse_products`' layout)."""
    if k_norm is not None:
        raise ValueError("a fused w_qkv is normed by fuse_products' joint q_norm (k_norm None)")
    return jnp.einsum("btd,kned->btkne", h_BTD, w_qkv_KNED)


def finish_qkv(qkv_BTKNE, input_scale, norm, eps):
    """q [B,T,H,E], k and v [B,T,K,E] of a fused product's output [B,T,K,G+2,E], times
    `input_scale` [B,T,1] if given. With Qwen3's norms, `fuse_products` made `norm` [G+2, E] (q's
    weight G times, k's, and ones): the output is normed whole, as it was written, and v taken
    from before the norm. One kernel of a rollout step, where the two norms and the slices of the
    product feeding them took up to four; norming v's head too costs 1 / (G+2) more of a small
    fusion."""
    qkv = scaled(qkv_BTKNE, input_scale)
    b, t, k, n, e = qkv.shape
    normed = qkv if norm is None else rms_norm(qkv, norm, eps)
    q_BTHE = normed[:, :, :, : n - 2].reshape(b, t, k * (n - 2), e)
    return q_BTHE, normed[:, :, :, -2], qkv[:, :, :, -1]


def swiglu(h_BTD, w_in, w_down, input_scale=None):
    """The SwiGLU MLP of Llama and Qwen; `w_in` is (w_gate, w_up) [D,F] and `w_down` [F,D], or
    the rollout's layout (`fuse_products`): the two stacked [2, F, D], and `w_down` [D,F]; the
    gate and up products times `input_scale` [B,T,1] if given (`fold_input_norms`)."""
    if isinstance(w_in, tuple):
        g_BTF, u_BTF = (scaled(jnp.einsum("btd,df->btf", h_BTD, w), input_scale) for w in w_in)
        down = "btf,fd->btd"
    else:
        gu = scaled(jnp.einsum("btd,cfd->btcf", h_BTD, w_in), input_scale)
        g_BTF, u_BTF = gu[:, :, 0], gu[:, :, 1]
        down = "btf,df->btd"
    return jnp.einsum(down, jax.nn.silu(g_BTF) * u_BTF, w_down)


def fold_input_norms(layer, *, attention: bool = True, mlp: bool = True):
    """`layer` (a decoder layer's copy, changed in place, before `fuse_products`) with its input
    norms' weights folded into the products they feed, with `attention` q/k/v, with `mlp`
    gate/up: RMSNorm(x, w) @ W = (x @ diag(w) W) / RMS(x). A rollout step then scales the
    products' outputs by 1 / RMS(x) (`inverse_rms`, fused into the kernels after them) instead of
    writing a normalised copy of x before them: one kernel less a norm. The folded norms become
    None (`normed_input` then gives the scale)."""
    if attention:
        fold_norm(layer, "attn_norm", ("wq", "wk", "wv"))
    if mlp:
        fold_norm(layer, "mlp_norm", ("w_gate", "w_up"))
    return layer


def fold_norm(module, norm: str, products: tuple[str, ...], axis: int = 0):
    """`module`'s RMSNorm weight `norm` folded into the weights `products` it feeds, along their
    input axis `axis`; the norm becomes None (`fold_input_norms`)."""
    w = getattr(module, norm)[...]
    for name in products:
        weight = getattr(module, name)[...]
        shape = [1] * weight.ndim
        shape[axis] = -1
        setattr(module, name, nnx.Param(weight * w.reshape(shape)))
    setattr(module, norm, None)


def normed_input(x_BTD, norm, eps: float):
    """A sublayer's input and the scale of the products it feeds: RMSNorm(x) and None, or, where
    the norm is folded into the products (`fold_input_norms`: `norm` None), x itself and
    1 / RMS(x)."""
    if norm is None:
        return x_BTD, inverse_rms(x_BTD, eps)
    return rms_norm(x_BTD, norm[...], eps), None


def rollout_weights(weights, dtype):
    """`weights` (a pytree) with each floating-point array cast to the compute `dtype`, behind an
    optimization barrier: a copy made once before a loop of rollout steps, which XLA would
    otherwise fuse back into the loop and redo at every step. Every weight is cast to the compute
    dtype where it is used, so the copy computes exactly what the weights do."""
    dtype = jnp.dtype(dtype)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.lax.optimization_barrier(jax.tree.map(cast, weights))


def remat_layer(body, remat: str, static_argnums=()):
    """`body` (one layer of a scan) under `ModelConfig.remat`: 'full' saves only its inputs,
    'dots' also the weight matmuls and attention's output and log-sum-exp (the backward then
    runs no second attention forward, for about a tenth more saved activations; pipeline stages,
    recomputed whole in the backward, still run it once more), 'none' everything."""
    if remat == "none":
        return body
    policy = None
    if remat == "dots":
        policy = jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(SAVED_ATTENTION),
        )
    return jax.checkpoint(body, prevent_cse=False, policy=policy, static_argnums=static_argnums)
