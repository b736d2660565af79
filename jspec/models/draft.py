"""Draft models for speculative decoding, behind one small interface (`Draft`).

Two kinds here (a multi-token-prediction head is `jspec.models.mtp.MTPDraft`, a
`OneLayerDraft` as EAGLE-3 is; a block draft, which drafts a whole chain in one forward,
`jspec.models.block.BlockDraft`):
- `Eagle3Draft`: the EAGLE-3 head. The target's hidden states entering three of its layers (its
  taps) are concatenated and projected (`fc`, 3H -> H); one decoder layer attends over
  concat(RMSNorm(token embedding), RMSNorm(fused feature)) (2H wide), with the residual taken from
  the fused feature (before `hidden_norm`, or after it with `norm_before_residual`); then an MLP, a
  final norm and an LM head over a draft vocabulary (the most frequent target tokens). The token
  embedding is the target's, passed in at every call (`Shared`), not a copy.
- `ExternalDraft`: any small `Transformer` that shares the target's tokenizer.

The interface, in the terms of one row (`jspec.sampler.generate` drives it and does not know
which kind it runs). A draft keeps a KV cache whose last slot is the *root's* slot: its output
there gives the logits of the tree's first level. Slot j holds, for EAGLE-3, the pair (target
feature at position j, token j + 1) at RoPE position j (the published pairing: the feature of a
token meets the embedding of the next one); for an external draft, token j at position j.
- `init_cache(batch, max_len)`: an empty cache for sequences of up to `max_len` target tokens.
- `prefill(shared, prompt, lengths, root, features, cache)`: fill the empty cache from the prompt
  and the first sampled token (`root`); returns the root's logits and hidden state.
- `extend(shared, tokens, features, count, cache)`: after a verify step, append the emitted tokens
  (`features[j]`: what the draft reads of the target, its `features`, at the position before
  `tokens[j]`); the last one is the new root.
- `tree_step(shared, tokens, parent_hidden, depth, parent, cache, tree)`: a level of the draft tree:
  nodes at RoPE position (root slot's position + depth), anchored at the root's slot, below
  earlier nodes (`TreeKV`) or the root (-1); returns their logits, hidden states and K/V.
`shared` holds the target's weights a draft may read (`Shared`: embedding and output head).
Logits always cover the target's whole vocabulary (-inf outside a draft vocabulary), in float32.
`prefill`, `extend` and `tree_step` attend to the cache on the kernels of `kernels=` (a static
`KernelConfig`: `RolloutConfig.kernels`; None: its defaults).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention import attention
from jspec.attention.decode import cache_slots
from jspec.config import ConfigError, KernelConfig, ModelConfig
from jspec.models import layers
from jspec.models.cache import CacheWriter, KVCache, TreeKV, cache_attention, last_valid
from jspec.models.transformer import Transformer, check_mesh, create_sharded

Taps = Float[Array, "taps b t d"]
Kernels = KernelConfig | None  # what attention to the cache runs on (None: `KernelConfig()`)


class Shared(NamedTuple):
    """The target's weights a draft reads but does not own: the token embedding and the output
    head [V, D] (one array when tied), passed in at every call so that no draft holds a copy."""

    embed: Float[Array, "v d"]
    head: Float[Array, "v d"]

    @classmethod
    def of(cls, target: Transformer) -> Shared:
        return cls(target.embed[...], target.head[...])


class DraftOut(NamedTuple):
    """The draft at the root (or at tree nodes): logits over the target vocabulary, the hidden
    state a child node takes as its feature (EAGLE-3; width 0 for an external draft), the cache."""

    logits: Float[Array, "b v"]
    hidden: Float[Array, "b h"]
    cache: KVCache


class Draft(Protocol):
    """What `jspec.sampler.generate` needs of a draft model (see the module docstring)."""

    num_layers: int  # layers of the draft's own cache and tree K/V
    # What `prefill` and `extend` read of the target's forward (`transformer.FEATURES`): its taps,
    # its final-normed hidden state, or None (nothing).
    features: str | None

    def init_cache(self, batch: int, max_len: int) -> KVCache: ...

    def prefill(
        self, shared, prompt, lengths, root, features: Taps, cache, *, kernels: Kernels = None
    ) -> DraftOut: ...

    def extend(
        self, shared, tokens, features: Taps, count, cache: KVCache, *, kernels: Kernels = None
    ) -> DraftOut: ...

    def tree_step(
        self, shared, tokens, parent_hidden, depth, parent, cache, tree: TreeKV, *, kernels=None
    ): ...

    def empty_tree(self, batch: int, capacity: int) -> TreeKV: ...

    def for_rollout(self) -> Draft: ...  # this draft in the layout a loop of steps wants

    def check_target(self, target: ModelConfig) -> None: ...  # ConfigError if it cannot serve


def check_eagle3_config(c: Eagle3Config, target: ModelConfig) -> None:
    """Raises ConfigError when an EAGLE-3 draft of config `c` cannot serve this target: what its
    config.json tells, before any weight is read."""
    target.check_taps("target model")
    if c.layer.hidden_size != target.hidden_size:
        raise ConfigError(
            f"the EAGLE-3 draft's hidden_size={c.layer.hidden_size} differs from the target's "
            f"{target.hidden_size}: the draft reads the target's embeddings and taps; use a "
            "draft trained for this target."
        )
    if c.num_taps != len(target.taps):
        raise ConfigError(
            f"the EAGLE-3 draft fuses {c.num_taps} taps but the target gives "
            f"{len(target.taps)} (model.tap_layers={target.taps})."
        )
    if c.tap_layers is not None and tuple(c.tap_layers) != tuple(target.taps):
        raise ConfigError(
            f"the EAGLE-3 draft reads the inputs of target layers {list(c.tap_layers)} (its "
            f"eagle_aux_hidden_state_layer_ids) but the target taps {list(target.taps)}; set "
            f"model.tap_layers={list(c.tap_layers)}, or use a draft trained on these taps."
        )
    if c.layer.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the EAGLE-3 draft maps its vocabulary into {c.layer.vocab_size} target tokens, "
            f"but the target's vocabulary has {target.vocab_size} (d2t/t2d do not match)."
        )


def check_target(draft, target: ModelConfig) -> None:
    """Raises ConfigError when the draft cannot serve this target (before any compilation), a
    TypeError for what is not a draft."""
    if not callable(getattr(draft, "check_target", None)):  # every kind has its own check
        raise TypeError(
            f"{type(draft).__name__} is not a draft kind (EAGLE-3, MTP head, block draft, "
            "external model)."
        )
    draft.check_target(target)


class TargetVocabulary:
    """What a draft whose vocabulary is the target's (it reads the target's output head: an MTP
    head, a block draft) does with logits between vocabularies: nothing."""

    def to_target_vocab(self, logits: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
        return logits

    def from_target_vocab(self, logits: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
        return logits


class OneLayerDraft(nnx.Module):
    """A draft of one decoder layer over what it reads of the target (its `features`) at each
    position, paired with the embedding of the next token; a tree level feeds the layer's output
    back in as its children's feature. EAGLE-3 (the fused taps) and a multi-token-prediction head
    (`jspec.models.mtp`: the final hidden state) are two of them: each gives `config.layer` (the
    layer's shape), `fuse` (the target's features -> the layer's input), `layer`,
    `draft_logits` and `to_target_vocab`; the cache, prefill, extend and tree levels are here."""

    num_layers = 1

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return draft_cache(self.config.layer, self.mesh, batch, max_len)

    def prefill(
        self, shared, prompt, lengths, root, features: Taps, cache, *, kernels: Kernels = None
    ) -> DraftOut:
        """Slots 0 .. n-1 of a prompt of n tokens: features of tokens 0 .. n-1 with tokens
        1 .. n-1 and the root."""
        b, t = prompt.shape
        nxt = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), prompt.dtype)], axis=1)
        nxt = jnp.where(jnp.arange(t) == lengths[:, None] - 1, root[:, None], nxt)
        return self.extend(shared, nxt, features, lengths, cache, kernels=kernels)

    def extend(
        self, shared, tokens, features: Taps, count, cache: KVCache, *, kernels: Kernels = None
    ) -> DraftOut:
        writer = CacheWriter(cache, count, tokens.shape[1], self.mesh, kernels)
        cos_sin = layers.rope_angles(self.config.layer, writer.q_positions)
        out, _ = self.layer(
            lookup(shared.embed, tokens), self.fuse(features), cos_sin, writer.layer(0)
        )
        last = last_valid(out, count)
        logits = self.to_target_vocab(self.draft_logits(last[:, None], shared))[:, 0]
        return DraftOut(logits, last, writer.cache)

    def tree_step(
        self, shared, tokens, parent_hidden, depth, parent, cache, tree: TreeKV, *, kernels=None
    ):
        anchor, positions = _tree_anchor_positions(cache, depth, tokens.shape)

        attend = lambda q, k, v: cache_attention(
            cache, 0, tree.branch(0, q, k, v, anchor, parent), self.mesh, kernels
        )

        cos_sin = layers.rope_angles(self.config.layer, positions)
        out, (k, v) = self.layer(lookup(shared.embed, tokens), parent_hidden, cos_sin, attend)
        logits = self.to_target_vocab(self.draft_logits(out, shared))
        return logits, out, k[None], v[None], anchor

    def empty_tree(self, batch: int, capacity: int) -> TreeKV:
        c = self.config.layer
        return TreeKV.empty(1, batch, capacity, c.num_kv_heads, c.head_dim, jnp.dtype(c.dtype))

    def from_target_vocab(self, logits: Float[Array, "*b v"]) -> Float[Array, "*b vd"]:
        """Target-vocabulary logits restricted to the draft's vocabulary (a teacher's)."""
        return logits[..., self.target_ids[...]]

    @property
    def _dtype(self):
        return jnp.dtype(self.config.layer.dtype)


# ---------------------------------------------------------------------------------------------
# EAGLE-3.


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft: `layer` is the shape of its one decoder layer (num_layers=1; vocab_size is
    the target's, which the draft vocabulary maps into), with RoPE and norms like the target's;
    `tap_layers`, the target layers whose inputs it reads (its checkpoint's
    eagle_aux_hidden_state_layer_ids), None where its checkpoint does not say."""

    layer: ModelConfig
    draft_vocab_size: int
    num_taps: int = 3
    norm_before_residual: bool = False
    tap_layers: tuple[int, ...] | None = None

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int = 0) -> Eagle3Config:
        """The usual draft of a target: its width, heads, MLP and RoPE, one layer, no q/k norm."""
        layer = dataclasses.replace(
            target, num_layers=1, qk_norm=False, tap_layers=None, num_experts=0, mlp_only_layers=()
        )
        vocab = draft_vocab_size or target.vocab_size
        return cls(layer=layer, draft_vocab_size=vocab, tap_layers=tuple(target.taps))

    def validate(self) -> None:
        self.layer.validate("draft")
        if self.layer.num_layers != 1:
            raise ConfigError(f"an EAGLE-3 draft has one layer, not {self.layer.num_layers}.")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, target vocabulary "
                f"{self.layer.vocab_size}]."
            )


class VocabMap(nnx.Variable):
    """Target token id of every draft token id: a constant, never trained."""


class Eagle3Draft(OneLayerDraft):
    """The EAGLE-3 draft head. Parameters carry logical axis names like the target's."""

    features = "taps"

    def __init__(
        self,
        config: Eagle3Config,
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
        target_ids: np.ndarray | None = None,
    ):
        """`target_ids`: the target token of each draft token (`frequent_tokens`); None: the
        first `draft_vocab_size` ids."""
        config.validate()
        c = config.layer
        check_mesh(
            dataclasses.replace(c, vocab_size=config.draft_vocab_size), mesh, "rollout.draft"
        )
        d, h, k, e, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        p = functools.partial(layers.init_param, rngs, dtype=jnp.dtype(c.param_dtype))
        self.config, self.mesh = config, mesh
        self.fc = p((config.num_taps * d, d), (None, "embed"), fan_in=config.num_taps * d)
        self.input_norm = p((d,), ("norm",), fan_in=None)
        self.hidden_norm = p((d,), ("norm",), fan_in=None)
        self.wq = p((2 * d, h, e), (None, "heads", "head_dim"), fan_in=2 * d)
        self.wk = p((2 * d, k, e), (None, "kv_heads", "head_dim"), fan_in=2 * d)
        self.wv = p((2 * d, k, e), (None, "kv_heads", "head_dim"), fan_in=2 * d)
        self.wo = p((h, e, d), ("heads", "head_dim", "embed"), fan_in=h * e)
        self.mlp_norm = p((d,), ("norm",), fan_in=None)
        self.w_gate = p((d, f), ("embed", "mlp"), fan_in=d)
        self.w_up = p((d, f), ("embed", "mlp"), fan_in=d)
        self.w_down = p((f, d), ("mlp", "embed"), fan_in=f)
        self.final_norm = p((d,), ("norm",), fan_in=None)
        self.lm_head = p((config.draft_vocab_size, d), ("vocab", "embed"), fan_in=d)
        if target_ids is None:
            target_ids = np.arange(config.draft_vocab_size)
        if np.shape(target_ids) != (config.draft_vocab_size,):
            raise ConfigError(
                f"target_ids has shape {np.shape(target_ids)}; the draft vocabulary needs one "
                f"target id per draft token: ({config.draft_vocab_size},)."
            )
        self.target_ids = VocabMap(jnp.asarray(target_ids, jnp.int32), axes=(None,))
        # True in a `for_rollout` copy whose head's rows are in target-id order: its logits are
        # already over the target vocabulary.
        self.target_order = False
        # Set by `for_rollout` in place of wq, wk, wv and of w_gate, w_up.
        self.w_qkv, self.w_gate_up = nnx.data(None), nnx.data(None)

    # -- the layer -----------------------------------------------------------------------------

    def fuse(self, features: Taps | Float[Array, "b t f"]) -> Float[Array, "b t d"]:
        """The taps [3,B,T,D], or already concatenated in tap order [B,T,3D] (the form public
        EAGLE-3 code passes), projected to the draft's width."""
        cat = features if features.ndim == 3 else jnp.concatenate(list(features), axis=-1)
        return jnp.einsum("btf,fd->btd", cat.astype(self._dtype), self.fc[...].astype(self._dtype))

    def layer(self, emb_BTD, hidden_BTD, cos_sin, attend):
        """The decoder layer: returns the output hidden state (the next step's feature) and the
        rotated (k, v) [B,T,K,E] (None where `attend` wrote them: `CacheWriter.layer`)."""
        c = self.config.layer
        w = lambda p: p[...].astype(self._dtype)
        fused = self.w_qkv is not None
        normed = layers.rms_norm(hidden_BTD, self.hidden_norm[...], c.rms_norm_eps)
        embedded = layers.rms_norm(
            emb_BTD.astype(self._dtype), self.input_norm[...], c.rms_norm_eps
        )
        h_BT2D = jnp.concatenate([embedded, normed], axis=-1)
        w_qkv = w(self.w_qkv) if fused else (w(self.wq), w(self.wk), w(self.wv))
        o_BTD, kv = layers.attention_sublayer(
            h_BT2D, w_qkv, w(self.wo), cos_sin, attend, eps=c.rms_norm_eps
        )
        x_BTD = (normed if self.config.norm_before_residual else hidden_BTD) + o_BTD
        h_BTD, scale = layers.normed_input(x_BTD, self.mlp_norm, c.rms_norm_eps)
        w_in = w(self.w_gate_up) if fused else (w(self.w_gate), w(self.w_up))
        x_BTD = x_BTD + layers.swiglu(h_BTD, w_in, w(self.w_down), scale)
        return x_BTD, kv

    def draft_logits(self, hidden_BTD, shared: Shared | None = None) -> Float[Array, "b t vd"]:
        """Logits over the draft vocabulary (float32), by the draft's own head (`shared` unused)."""
        x, scale = layers.normed_input(hidden_BTD, self.final_norm, self.config.layer.rms_norm_eps)
        w = self.lm_head[...].astype(x.dtype)
        return layers.scaled(
            jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32), scale
        )

    def check_target(self, target: ModelConfig) -> None:
        check_eagle3_config(self.config, target)
        ids = np.asarray(jax.device_get(self.target_ids[...]))
        if ids.min() < 0 or ids.max() >= target.vocab_size or np.unique(ids).size != ids.size:
            raise ConfigError(
                "the EAGLE-3 draft's vocabulary map (d2t) sends draft ids outside the target's "
                f"vocabulary of {target.vocab_size} or onto one target token twice."
            )

    def to_target_vocab(self, logits_d: Float[Array, "*b vd"]) -> Float[Array, "*b v"]:
        """Draft-vocabulary logits placed at their target ids; -inf at every other target id."""
        if self.target_order:
            return logits_d
        v = self.config.layer.vocab_size
        full = jnp.full((*logits_d.shape[:-1], v), -jnp.inf, jnp.float32)
        return full.at[..., self.target_ids[...]].set(logits_d)

    def __call__(
        self,
        embeds: Float[Array, "b t d"],
        features: Taps | Float[Array, "b t d"],
        segment_ids: Int[Array, "b t"],
        positions: Int[Array, "b t"],
    ) -> tuple[Float[Array, "b t vd"], Float[Array, "b t d"]]:
        """One causal pass over packed rows: position t pairs `embeds[t]` with `features[t]` (the
        target's taps [3,B,T,D] or their concatenation [B,T,3D], fused here, or a fused or
        earlier-step hidden state [B,T,D]; any other shape is a ValueError at trace time).
        Returns logits over the draft vocabulary and the output hidden states."""
        hidden = self._hidden(features, embeds.shape[:2])
        attend = lambda q, k, v: attention(q, k, v, segment_ids, positions)
        cos_sin = layers.rope_angles(self.config.layer, positions)
        out, _ = self.layer(embeds, hidden, cos_sin, attend)
        return self.draft_logits(out), out

    def for_rollout(self) -> Eagle3Draft:
        """A copy of this draft for a loop of rollout steps: its input products fused as the
        target's are (`fuse_products`: two products instead of five, each step drafts one to a
        few times), the norms before gate/up and before the head folded into them (as the
        target's are: `fold_input_norms`), its weights cast to the compute dtype once
        (`rollout_weights`), and, when it drafts the whole target vocabulary, its head in target
        order (`target_order`)."""
        constrain = lambda x, names: mesh_lib.constrain(x, self.mesh, names)
        # q/k/v read two inputs, normed apart, so their norms stay where they are
        draft = layers.fold_input_norms(nnx.merge(*nnx.split(self)), attention=False)
        layers.fold_norm(draft, "final_norm", ("lm_head",), axis=1)
        # q/k/v read [embedding, hidden state] (2D), which the mesh does not split
        draft = layers.fuse_products(draft, constrain, input_axis=None)
        graphdef, state = nnx.split(draft)
        draft = nnx.merge(graphdef, layers.rollout_weights(state, self._dtype))
        if self.config.draft_vocab_size == self.config.layer.vocab_size:
            # Every target token is drafted: the head's rows put in target-id order once, so
            # that no tree step scatters its logits into the target vocabulary.
            ids = draft.target_ids[...]
            draft.lm_head[...] = draft.lm_head[...][jnp.argsort(ids)]
            draft.target_ids[...] = jnp.arange(ids.shape[0], dtype=ids.dtype)
            draft.target_order = True
        return draft

    # -- internals -----------------------------------------------------------------------------

    def _hidden(self, features, batch_time: tuple[int, int]) -> Float[Array, "b t d"]:
        """The layer's input feature from what `__call__` was given, told apart by shape (checked
        here: a wrong one would otherwise fail deep inside as an opaque broadcasting error)."""
        n, d = self.config.num_taps, self.config.layer.hidden_size
        b, t = batch_time
        read = {  # with one tap, [B,T,D] is read as a hidden state (the later key wins)
            (n, b, t, d): self.fuse,
            (b, t, n * d): self.fuse,
            (b, t, d): lambda x: x.astype(self._dtype),
        }
        if features.shape not in read:
            raise ValueError(
                f"features has shape {tuple(features.shape)}; Eagle3Draft takes the target's "
                f"{n} taps [{n}, B, T, D] = {(n, b, t, d)}, their concatenation [B, T, {n}*D] = "
                f"{(b, t, n * d)}, or a hidden state [B, T, D] = {(b, t, d)} (B, T from embeds, "
                f"D = hidden_size {d})."
            )
        return read[features.shape](features)


def lookup(embed: Float[Array, "v d"], tokens: Int[Array, "b t"]) -> Float[Array, "b t d"]:
    """The target's embedding of each token (padding tokens may be negative)."""
    return jnp.take(embed, tokens, axis=0, mode="clip")


def draft_cache(layer: ModelConfig, mesh, batch: int, max_len: int) -> KVCache:
    """A draft's cache of `layer.num_layers` layers; its length follows the target's positions,
    not the draft's own max_seq_len (RoPE of the draft follows the target's)."""
    slots = cache_slots(max_len)
    layer = dataclasses.replace(layer, max_seq_len=max(slots, layer.max_seq_len))
    model = nnx.eval_shape(lambda: Transformer(layer, rngs=nnx.Rngs(0), mesh=mesh))
    return model.init_cache(batch, slots)


def _tree_anchor_positions(cache: KVCache, depth, shape):
    """Tree nodes hang off the root's slot (the last written) at its position + depth."""
    root_slot = (cache.length - 1)[:, None]
    anchor = jnp.broadcast_to(root_slot, shape).astype(jnp.int32)
    return anchor, jnp.broadcast_to(root_slot + depth, shape).astype(jnp.int32)


def frequent_tokens(token_counts, n: int) -> np.ndarray:
    """The draft vocabulary of EAGLE-3: the n most frequent target tokens, in id order."""
    counts = np.asarray(token_counts)
    return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int32)


def create_eagle3(
    config: Eagle3Config,
    *,
    mesh: Mesh | None = None,
    seed: int = 0,
    target_ids: np.ndarray | None = None,
) -> Eagle3Draft:
    """A randomly initialised EAGLE-3 draft, born sharded over `mesh` (as `models.create`)."""
    make = lambda: Eagle3Draft(config, rngs=nnx.Rngs(seed), mesh=mesh, target_ids=target_ids)
    ids = None if target_ids is None else (np.shape(target_ids), *np.ravel(target_ids).tolist())
    return create_sharded(make, mesh, (Eagle3Draft, config, seed, ids))


# ---------------------------------------------------------------------------------------------
# External.


class ExternalDraft(nnx.Module):
    """A small decoder sharing the target's tokenizer, used as a draft: its cache mirrors the
    target's sequence, root included; its tree levels are branch forwards (no hidden feature)."""

    features = None

    def __init__(self, model: Transformer):
        self.model = model

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        slots = cache_slots(max_len + 1, self.model.config.max_seq_len)  # the root: one ahead
        return self.model.init_cache(batch, slots)

    def for_rollout(self) -> ExternalDraft:
        return ExternalDraft(self.model.for_rollout())

    def check_target(self, target: ModelConfig) -> None:
        v = self.model.config.vocab_size
        if v != target.vocab_size:
            raise ConfigError(
                f"the external draft's vocab_size={v} differs from the target's "
                f"{target.vocab_size}: an external draft must share the target's tokenizer."
            )

    def prefill(
        self, shared, prompt, lengths, root, features: Taps, cache, *, kernels: Kernels = None
    ) -> DraftOut:
        """Slots 0 .. n: the prompt, then the root."""
        b, t = prompt.shape
        seq = jnp.concatenate([prompt, jnp.zeros((b, 1), prompt.dtype)], axis=1)
        seq = jnp.where(jnp.arange(t + 1) == lengths[:, None], root[:, None], seq)
        return self.extend(shared, seq, None, lengths + 1, cache, kernels=kernels)

    def extend(
        self, shared, tokens, features: Taps, count, cache: KVCache, *, kernels: Kernels = None
    ) -> DraftOut:
        logits, cache = self.model.prefill(tokens, cache, count, kernels=kernels)
        return DraftOut(logits, jnp.zeros((tokens.shape[0], 0), logits.dtype), cache)

    def tree_step(
        self, shared, tokens, parent_hidden, depth, parent, cache, tree: TreeKV, *, kernels=None
    ):
        anchor, positions = _tree_anchor_positions(cache, depth, tokens.shape)
        logits, k, v = self.model.branch_forward(
            cache, tokens, positions, anchor, parent, earlier=tree, kernels=kernels
        )
        return logits, parent_hidden, k, v, anchor

    def empty_tree(self, batch: int, capacity: int) -> TreeKV:
        c = self.model.config
        return TreeKV.empty(
            c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, jnp.dtype(c.dtype)
        )
