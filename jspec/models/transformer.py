"""A decoder-only LM of the Llama 3 / Qwen3 families, in Flax NNX.

One layer body (`Block.__call__`) serves every use; what differs is how it is driven:

- training (`Transformer.__call__`): packed rows, layers scanned (`jax.lax.scan`) under the remat
  policy of `ModelConfig.remat`; on a mesh, attention is `jspec.attention`'s ring under
  `shard_map`, and with a context axis the rows run in the zigzag order of the ring (documents
  padded to 2 * cp);
- rollout (`prefill`, `decode`, `branch_forward`): layers stepped through in a Python loop that
  indexes the stacked weights, because a scanned stack streams weights 1.7-2.5x slower in decode
  (docs/gpu.md).

Mixture of experts (`jspec.models.moe`): layers with the sparse MLP are stacked apart from those
with the dense MLP (`layer_stacks`), as the two have different weights; training scans each run of
consecutive layers of one kind, rollout steps through the layers in order, from either stack.

Attention itself is `jspec.attention`: the layer rotates q and k and hands them over
(`jspec.models.layers` holds the pieces of a layer). Decode is a one-token prefill: the token's K/V
are written into the cache, layer by layer in place, and the token attends to the cache.
Verification is the branch forward (nodes hanging off the last cached token); `KVCache.append`
then writes the accepted nodes (`jspec.models.cache`: the cache and rollout attention, on the
kernels a `KernelConfig` names).

Shape suffixes: B batch, T tokens, N branch nodes, S cache slots, L layers, D hidden, H query heads,
K key/value heads, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention import Branch, attention, zigzag_shard, zigzag_unshard
from jspec.attention.parallel import sharded_ring
from jspec.attention.zigzag import check_alignment, concrete, mark_misaligned
from jspec.config import ConfigError, KernelConfig, ModelConfig
from jspec.models import output_head
from jspec.models.cache import KV, CacheWriter, KVCache, TreeKV, cache_attention, last_valid
from jspec.models.layers import (
    attention_sublayer,
    fold_input_norms,
    fuse_products,
    init_param,
    normed_input,
    remat_layer,
    rms_norm,
    rollout_weights,
    rope_angles,
    swiglu,
)
from jspec.models.moe import MoE, load_balancing_loss

# Batch and sequence names of activations, in training and in rollout (where the context axis
# serves as extra data parallelism: docs/architecture.md).
TRAIN_ACT = ("batch", "seq")
ROLLOUT_ACT = ("decode_batch", None)

Taps = Float[Array, "taps b t d"]  # hidden states entering the layers config.taps (T may be absent)
# What a draft reads of the target's forward (`features=`): nothing, the hidden states entering the
# layers `config.taps` (EAGLE-3), or the final-normed hidden state the output head reads (a
# multi-token-prediction head), as F feature vectors [F,B,T,D] (F = len(taps), or 1).
FEATURES = (None, "taps", "final")

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


def check_mesh(config: ModelConfig, mesh: Mesh | None, where: str = "model") -> None:
    """Raises ConfigError if a parameter axis does not divide over the mesh axes it is split on
    (`where`: the config section the fields are named under)."""
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
                f"{where}.{field}={value} is not divisible by {size}, the size of {mesh_size} that "
                f"parameter axis {name!r} is split over; set {mesh_size} to a divisor of {value},"
                f" or a {where}.{field} that is a multiple of {size}."
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
        p = functools.partial(init_param, rngs, dtype=jnp.dtype(c.param_dtype))
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

        Returns the new residual stream, this layer's (k, v) [B,T,K,E], rotated, for caches (None
        where `attend` wrote them into its cache: `CacheWriter.layer`), and the router's
        `RouterStats` (None for a dense MLP).
        """
        c = self.config
        w = lambda p: None if p is None else p[...].astype(jnp.dtype(c.dtype))
        fused = self.w_qkv is not None
        h_BTD, scale = normed_input(x_BTD, self.attn_norm, c.rms_norm_eps)
        w_qkv = w(self.w_qkv) if fused else (w(self.wq), w(self.wk), w(self.wv))
        norms = dict(q_norm=w(self.q_norm), k_norm=w(self.k_norm), eps=c.rms_norm_eps)
        o_BTD, kv = attention_sublayer(
            h_BTD, w_qkv, w(self.wo), cos_sin, attend, input_scale=scale, **norms
        )
        x_BTD = x_BTD + o_BTD
        h_BTD, scale = normed_input(x_BTD, self.mlp_norm, c.rms_norm_eps)
        if self.moe is not None:
            y_BTD, stats = self.moe(h_BTD, valid_BT, act)
            return x_BTD + y_BTD, kv, stats
        w_in = w(self.w_gate_up) if fused else (w(self.w_gate), w(self.w_up))
        return x_BTD + swiglu(h_BTD, w_in, w(self.w_down), scale), kv, None

    def fused(self, constrain) -> Block:
        """A copy of this one-layer block (a slice of the stacks) with its input products fused,
        for the rollout loop: q, k and v as one matrix [K, G+2, E, D] (each KV head's G query
        heads, then its k and v, so a mesh that splits the KV heads keeps every group whole), and
        gate and up as one [2, F, D], every weight outputs first (`fuse_products` says why). A
        decode step reads the same bytes in two matrix products instead of five: at batch 1 on
        the GPU, small products such as k and v ran far below the memory bandwidth, while plain
        XLA with fused matrices streams the Qwen3-8B weights at 97% of it. `constrain(x, logical
        axis names)` places the fused weights on a mesh, as the unfused ones are (a KV head's
        group, a slice of the MLP width, on one device). The input norms are folded into the
        products (`fold_input_norms`)."""
        mlp = self.moe is None
        layer = fold_input_norms(nnx.merge(*nnx.split(self)), mlp=mlp)
        return fuse_products(layer, constrain, mlp=mlp)


# ---------------------------------------------------------------------------------------------
# The model.


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
        self.embed = init_param(rngs, vd, ("vocab", "embed"), pdt, c.hidden_size)
        stacks = layer_stacks(config)
        dense, sparse = stacks.get("layers"), stacks.get("moe_layers")
        self.layers = Block(config, len(dense), rngs=rngs) if dense else None
        self.moe_layers = (
            Block(config, len(sparse), rngs=rngs, sparse=True, mesh=mesh) if sparse else None
        )
        self.final_norm = init_param(rngs, (c.hidden_size,), ("norm",), pdt, None)
        tied = c.tie_embeddings
        self.unembed = (
            None if tied else init_param(rngs, vd, ("vocab", "embed"), pdt, c.hidden_size)
        )
        self.unstacked = nnx.data(None)  # set by `for_rollout`

    # -- training ------------------------------------------------------------------------------

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        segment_ids: Int[Array, "b t"] | None = None,
        positions: Int[Array, "b t"] | None = None,
        *,
        features: str | None = None,
        aux_loss: bool = False,
        head: bool = True,
    ) -> Float[Array, "b t v"] | tuple[Array, ...]:
        """Logits (float32) of packed rows, or with `head` False the final-normed hidden states
        [B,T,D] (a loss applies the head: `output_head`); with `features`, also what a draft
        reads of them (`FEATURES`, [F,B,T,D], not detached: the caller stops their gradient);
        with `aux_loss`, last, the router's load-balancing loss over the non-padding tokens (a
        scalar, `transformers`' `aux_loss`; 0 without sparse layers), of which a training loss
        adds `config.router_aux_loss_coef` times. segment_ids None: one document per row;
        positions None: 0..T-1 in every row (pass them for packed rows, restarting at each
        document)."""
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
        if self.mesh is not None and self.mesh.size > 1:
            # Under shard_map, rows and heads split (one ring step when cp = 1): a Pallas kernel
            # has no SPMD partitioning rule (Mosaic refuses to compile; for Triton's, XLA would
            # gather every row and head to every device).
            axes = dict(batch_axis=mesh_lib.RULES["batch"], head_axis=mesh_lib.RULES["act_heads"])
            ring = sharded_ring(self.mesh, mesh_lib.RULES["seq"], **axes)
            attend = lambda q, k, v, seg, pos: ring(q, k, v, seg, pos, None)[0]
        else:
            attend = attention
        x_BTD = self._embed(tokens, TRAIN_ACT)
        cos_sin = rope_angles(self.config, positions)
        taps = features == "taps"
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
        normed_BTD = self._final(x_BTD)
        out = (self._head(normed_BTD, TRAIN_ACT) if head else normed_BTD,)
        out += self._features(features, taps_, normed_BTD)
        if aux_loss:
            out += (jnp.zeros(()) if stats is None else load_balancing_loss(stats),)
        return out if len(out) > 1 else out[0]

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
        features: str | None = None,
        kernels: KernelConfig | None = None,
    ) -> tuple[Float[Array, "b v"], KVCache] | tuple[Float[Array, "b v"], KVCache, Taps]:
        """Runs right-padded tokens (row b: the first `lengths[b]`; None: all T) into the cache,
        continuing each row's document at position `cache.length[b]` (0 for a new cache).

        Returns the logits after each row's last new token, the cache with the tokens written and,
        with `features`, those of every new token [F,B,T,D] (`FEATURES`). A row given no new
        token has no such logits: that is an error for concrete lengths, and NaN logits under `jit`.
        `kernels`: what attention to the cache runs on (None: `KernelConfig()`).
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
        normed_BTD, cache, out = self._write(tokens, cache, lengths, features, kernels)
        logits = self._head(last_valid(normed_BTD, lengths)[:, None], ROLLOUT_ACT)[:, 0]
        return (logits, cache, *out)

    def extend(
        self,
        tokens: Int[Array, "b t"],
        cache: KVCache,
        lengths: Int[Array, " b"],
        *,
        features: str | None = None,
        kernels: KernelConfig | None = None,
    ) -> tuple[Float[Array, "b t v"], KVCache] | tuple[Float[Array, "b t v"], KVCache, Taps]:
        """`prefill` with the logits after every token [B,T,V] (those past a row's `lengths` are
        undefined): the verify of a chain of draft tokens, which attend to the cache and to each
        other causally, as prefill's tokens do; `KVCache.forget` then drops the rejected ones."""
        normed_BTD, cache, out = self._write(tokens, cache, lengths, features, kernels)
        return (self._head(normed_BTD, ROLLOUT_ACT), cache, *out)

    def decode(
        self,
        token: Int[Array, " b"],
        cache: KVCache,
        *,
        features: str | None = None,
        kernels: KernelConfig | None = None,
    ) -> tuple[Float[Array, "b v"], KVCache] | tuple[Float[Array, "b v"], KVCache, Taps]:
        """One token per row at position `cache.length`: logits [B,V], the cache with the token
        appended, and with `features` the token's [F,B,D] (`kernels`: as `prefill`)."""
        out = self.prefill(token[:, None], cache, features=features, kernels=kernels)
        return (*out[:2], out[2][:, :, 0]) if features else out

    def branch_forward(
        self,
        cache: KVCache,
        tokens: Int[Array, "b n"],
        positions: Int[Array, "b n"],
        anchor: Int[Array, "b n"],
        parent: Int[Array, "b n"],
        *,
        features: str | None = None,
        earlier: TreeKV | None = None,
        kernels: KernelConfig | None = None,
    ) -> tuple[Float[Array, "b n v"], KV, KV] | tuple[Float[Array, "b n v"], KV, KV, Taps]:
        """Branch tokens against the cache (the verify pass of speculative decoding).

        Node i of row b is token `tokens[b, i]` at `positions[b, i]` (the root's position + depth),
        hanging off cache slot `anchor[b, i]` (-1: padding node) below node `parent[b, i]` (-1:
        none); it sees the cache up to its anchor and its ancestors. With `earlier` (nodes of
        earlier steps of a tree expansion), parents index those C nodes followed by these N.
        Negative tokens are allowed for padding nodes. Returns logits [B,N,V], the nodes' K and V
        [L,B,N,K,E] (for `KVCache.append` of the accepted ones, or `TreeKV.add`) and, with
        `features`, theirs [F,B,N,D] (`FEATURES`). The cache is not changed. `kernels`: as
        `prefill`.
        """

        def attend(i, q, k, v):
            if earlier is None:
                branch = Branch(q, k, v, anchor, parent)
            else:
                branch = earlier.branch(i, q, k, v, anchor, parent)
            return cache_attention(cache, i, branch, self.mesh, kernels)

        x_BND = self._embed(tokens, ROLLOUT_ACT)
        layer_attend = lambda i: functools.partial(attend, i)
        x_BND, taps_, (k, v) = self._unrolled(
            x_BND, rope_angles(self.config, positions), layer_attend, features == "taps"
        )
        normed_BND = self._final(x_BND)
        logits = self._head(normed_BND, ROLLOUT_ACT)
        return (logits, k, v, *self._features(features, taps_, normed_BND))

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

    def _write(self, tokens, cache: KVCache, lengths, features, kernels):
        """The final-normed hidden states of new tokens, the cache with the first `lengths[b]`
        of them written (each layer writes its K/V, then attends), and the `features` asked for."""
        writer = CacheWriter(cache, lengths, tokens.shape[1], self.mesh, kernels)
        x_BTD = self._embed(tokens, ROLLOUT_ACT)
        cos_sin = rope_angles(self.config, writer.q_positions)
        x_BTD, taps_, _ = self._unrolled(x_BTD, cos_sin, writer.layer, features == "taps")
        normed_BTD = self._final(x_BTD)
        return normed_BTD, writer.cache, self._features(features, taps_, normed_BTD)

    def _final(self, x_BTD):
        """The final norm: the hidden state the output head reads."""
        return rms_norm(x_BTD, self.final_norm[...], self.config.rms_norm_eps)

    def _head(self, normed_BTD, act):
        """Logits (float32) of final-normed hidden states."""
        return self._constrain(output_head.logits(normed_BTD, self.head[...]), (*act, "act_vocab"))

    @property
    def head(self) -> nnx.Param:
        """The output head's weights [V, D]: the embedding when tied."""
        return self.embed if self.unembed is None else self.unembed

    @staticmethod
    def _features(kind: str | None, taps: list, normed_BTD) -> tuple:
        """What `kind` of `FEATURES` asks for, as the one trailing output of a forward (none for
        None): the taps, or the final-normed hidden state as one feature."""
        if kind not in FEATURES:
            raise ValueError(f"features={kind!r} is not one of {FEATURES}.")
        if kind is None:
            return ()
        return (jnp.stack(taps) if kind == "taps" else normed_BTD[None],)

    def _stacks(self) -> dict[str, tuple[nnx.GraphDef, nnx.State]]:
        return {name: nnx.split(getattr(self, name)) for name in layer_stacks(self.config)}

    def _runs(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Layers start..stop-1 as runs (stack, first, end) of consecutive layers of one stack."""
        stacks = layer_stacks(self.config).items()
        where = {i: (name, j) for name, ids in stacks for j, i in enumerate(ids)}
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

    def _unrolled(self, x_BTD, cos_sin, layer_attend, taps: bool):
        """All layers by a Python loop (decode-speed weight streaming); collects every layer's K/V
        (None where `attend` wrote them into a cache itself: `CacheWriter.layer`).

        `layer_attend(i)` is layer i's `attend`, to read layer i of a cache.
        """
        entering, kvs = {}, []
        layers = self._layers() if self.unstacked is None else self.unstacked
        for i, layer in enumerate(layers):
            x_BTD = entering[i] = self._constrain(x_BTD, (*ROLLOUT_ACT, "act_embed"))
            x_BTD, kv, _ = layer(x_BTD, cos_sin, layer_attend(i), ROLLOUT_ACT)
            kvs.append(kv)
        tapped = [entering[t] for t in self.config.taps] if taps else []
        stacked = None if None in kvs else tuple(map(jnp.stack, zip(*kvs, strict=True)))
        return x_BTD, tapped, stacked


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
    make = lambda: Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh)
    return create_sharded(make, mesh, (Transformer, config, seed))


@functools.lru_cache(maxsize=16)
def _init_slot(key, mesh: Mesh | None) -> dict:
    return {}  # create_sharded's init of `key`: repeated runs in a process compile it once


def create_sharded(make, mesh: Mesh | None, key=None):
    """The module `make()` builds, initialised under `jit` straight into its parameters' shardings
    over `mesh` (None: default placement); calls of one `key` (what `make` reads) share the init."""
    slot = {} if key is None else _init_slot(key, mesh)
    if not slot:
        graphdef, abstract = nnx.split(nnx.eval_shape(make))
        out = None if mesh is None else param_shardings(abstract, mesh)
        slot.update(graphdef=graphdef, init=jax.jit(lambda: nnx.state(make()), out_shardings=out))
    return nnx.merge(slot["graphdef"], slot["init"]())
