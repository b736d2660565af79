"""A block draft in the style of DFlash ("DFlash: Block Diffusion for Flash Speculative Decoding",
2025; github.com/z-lab/dflash, and SpecForge's trainer of it): a few decoder layers that predict a
whole block of masked positions in one forward, conditioned on the target's features.

What it follows. The target's taps (hidden states of three layers, as EAGLE-3 reads them:
`features="taps"`) are concatenated, projected to the draft's width (`fc`) and normalised
(`hidden_norm`): the context. A block of `block_size` positions follows the last token whose
features are known: position 0 holds the root (the last sampled token, embedded by the target's
embedding), positions 1 .. block_size - 1 a mask embedding. In every layer the block's queries
attend to the context's keys and values, which each layer projects from the same fused context
(its own `wk`, `wv`, k-norm and RoPE at the context's positions; the context is never updated by
the layers), and to the keys and values of every position of the block (bidirectional within the
block). After the layers a final norm and the target's own output head give, at block position k,
the token k places after the root (not the next one: same-position prediction). The proposal is
a chain of those tokens, one forward for all of them: drawn at temperature > 0 from each
position's sampling distribution (which `verify` then receives as the draft's probabilities),
argmax at 0. Training (`jspec.rl.draft_loss.block_passes`) puts a block after every trunk token:
anchored there, it sees the context up to that token (DFlash's "strictly before the block's first
token") and its own block; position k is weighted decay**(k - 1), DFlash's exp(-(k - 1) / gamma).

Where it differs. DFlash's mask is a token of the target's vocabulary (a spare embedding row);
here it is a vector of the draft's own, learned, so any target serves. DFlash trains on up to 512
anchors sampled at random per sequence with hard labels (the data's tokens), as one weighted mean;
here every position of a packed row is an anchor (deterministic, so equal under every mesh; the
cost is block_size times a causal pass, bounded by `rl.draft_rows`), and the loss is the soft
cross-entropy against the detached policy at the sampling temperature, a mean per block position
summed with weights decay**(k - 1), as the EAGLE-3 co-training loss does. Bidirectional attention
within a block is one `jspec.attention.Branch`: the block's positions are a chain of nodes anchored
at the context's last token, and every query of the block belongs to the chain's last node, which
sees the whole chain (so context parallelism and the ring come for free).

The chained head (`chained=True`, jspec's own; Hydra's sequentially dependent heads in spirit). In
one forward a position's distribution cannot depend on the tokens drawn before it, so at
temperature 1 each is drawn from its marginal and a chain rarely survives its second token. The
chained head makes the block's output at position k depend on the token drawn at k - 1:
z_0 = h_0 (the root's output), z_k = h_k + chain_out(silu(chain_in([final_norm(z_{k-1}),
embed(x_{k-1})]))), logits_k = head(final_norm(z_k)), with x_0 the root; `chain_out` starts at
zero, so a fresh chained draft starts as the parallel one. It costs a small MLP and the output
head per tree level (the layers still run once per block), and training feeds the data's tokens
as x (teacher forcing). Either head proposes any tree kind of depth up to block_size - 1
(`jspec.sampler.tree_proposal.propose_block`): without the chained head, siblings are drawn from
the same marginal, a Medusa-style tree.

Checkpoints: `jspec.models.hf_block` reads and writes DFlash's layout where it maps (a draft of
three target layers; DFlash taps layer outputs, jspec layer inputs, one layer apart; the mask
written as a tensor of its own, or read from the target's embedding row `mask_token_id`). The
one published config read here (z-lab/dflash's DFlash2 test fixture) taps five target layers,
which a jspec target (three taps) cannot feed: such drafts are refused, naming the layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jspec.attention import Branch
from jspec.config import ConfigError, ModelConfig, TreeConfig, check_block_tree
from jspec.models import layers
from jspec.models.cache import KVCache, cache_attention
from jspec.models.draft import (
    DraftOut,
    Kernels,
    Shared,
    Taps,
    TargetVocabulary,
    draft_cache,
    lookup,
)
from jspec.models.transformer import TRAIN_ACT, Block, create_sharded


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A block draft: `layer` is the shape of its decoder layers (`layer.num_layers` of them, the
    target's width, heads, MLP, RoPE and vocabulary, q/k norms as DFlash's Qwen3 layers);
    `block_size` positions per forward (the root and block_size - 1 predicted tokens); `chained`:
    the chained head (module docstring)."""

    layer: ModelConfig
    block_size: int = 8
    num_taps: int = 3
    chained: bool = False

    @classmethod
    def for_target(
        cls, target: ModelConfig, block_size: int = 8, num_layers: int = 1, chained: bool = False
    ) -> BlockConfig:
        """The usual draft of a target: its layer shape, `num_layers` dense layers."""
        layer = dataclasses.replace(
            target,
            num_layers=num_layers,
            qk_norm=True,
            tap_layers=None,
            num_experts=0,
            mlp_only_layers=(),
        )
        return cls(layer=layer, block_size=block_size, chained=chained)

    def validate(self) -> None:
        self.layer.validate("draft")
        if self.block_size < 2:
            raise ConfigError(
                f"a block draft's block_size={self.block_size} must be >= 2: the root and at "
                "least one predicted token (rollout.draft.block_size)."
            )
        if self.layer.num_experts:
            raise ConfigError("a block draft's layers are dense; set num_experts=0.")


def check_block_config(c: BlockConfig, target: ModelConfig) -> None:
    """Raises ConfigError when a block draft of config `c` cannot serve this target: it reads the
    target's taps and shares its embedding and output head."""
    target.check_taps("target model")
    for name in ("hidden_size", "vocab_size"):
        if getattr(c.layer, name) != getattr(target, name):
            raise ConfigError(
                f"the block draft's {name}={getattr(c.layer, name)} differs from the target's "
                f"{getattr(target, name)}: it reads the target's taps and shares its embedding "
                "and output head; use a draft made for this target."
            )
    if c.num_taps != len(target.taps):
        raise ConfigError(
            f"the block draft fuses {c.num_taps} taps but the target gives {len(target.taps)} "
            f"(model.tap_layers={target.taps})."
        )


class BlockDraft(TargetVocabulary, nnx.Module):
    """The block draft (module docstring). Its cache holds the context's keys and values, one
    slot per target position (slot j: the feature at position j), `num_layers` layers; a block's
    root sits at the slot after the last. Parameters carry logical axis names like the target's;
    its layers are a `Block`, the target's own layer code."""

    features = "taps"

    def __init__(self, config: BlockConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        config.validate()
        c = config.layer
        d = c.hidden_size
        p = functools.partial(layers.init_param, rngs, dtype=jnp.dtype(c.param_dtype))
        self.config, self.mesh = config, mesh
        self.fc = p((config.num_taps * d, d), (None, "embed"), fan_in=config.num_taps * d)
        self.hidden_norm = p((d,), ("norm",), fan_in=None)
        self.mask = p((d,), ("embed",), fan_in=d)  # the masked positions' embedding
        self.layers = Block(c, c.num_layers, rngs=rngs)
        self.final_norm = p((d,), ("norm",), fan_in=None)
        if config.chained:
            self.chain_in = p((2 * d, d), (None, "embed"), fan_in=2 * d)
            self.chain_out = nnx.Param(jnp.zeros((d, d), c.param_dtype), axes=(None, "embed"))
        self.rollout_layers = nnx.data(None)  # set by `for_rollout`: the layers, sliced once

    @property
    def num_layers(self) -> int:
        return self.config.layer.num_layers

    @property
    def _dtype(self):
        return jnp.dtype(self.config.layer.dtype)

    # -- the layers ----------------------------------------------------------------------------

    def fuse(self, taps: Taps) -> Float[Array, "b t d"]:
        """The context: the taps concatenated, projected (`fc`) and normalised (`hidden_norm`)."""
        cat = jnp.concatenate(list(taps), axis=-1).astype(self._dtype)
        x = jnp.einsum("btf,fd->btd", cat, self.fc[...].astype(self._dtype))
        return layers.rms_norm(x, self.hidden_norm[...], self.config.layer.rms_norm_eps)

    def block_inputs(self, shared: Shared, roots: Int[Array, "*r"]) -> Float[Array, "k *r d"]:
        """The block's inputs at every root [block_size, *roots.shape, D]: the root's embedding
        (the target's), then the mask embedding."""
        root = lookup(shared.embed, roots).astype(self._dtype)
        mask = jnp.broadcast_to(self.mask[...].astype(self._dtype), root.shape)
        return jnp.stack([root] + [mask] * (self.config.block_size - 1))

    def context_kv(self, layer: Block, ctx_BTD, cos_sin):
        """A layer's keys and values [B,T,K,E] of the context (k-normed, rotated)."""
        c = self.config.layer
        w = lambda p: p[...].astype(self._dtype)
        k_BTKE = jnp.einsum("btd,dke->btke", ctx_BTD, w(layer.wk))
        k_BTKE = layers.rms_norm(k_BTKE, w(layer.k_norm), c.rms_norm_eps)
        v_BTKE = jnp.einsum("btd,dke->btke", ctx_BTD, w(layer.wv))
        return layers.apply_rope(k_BTKE, cos_sin), v_BTKE

    def forward(self, x_BND, cos_sin, attend) -> Float[Array, "b n d"]:
        """The layers over block positions x; `attend(i, layer, q, k, v)` is layer i's
        attention of the block's rotated q, k, v to the context and the block."""
        for i, layer in enumerate(self._layers()):
            layer_attend = functools.partial(attend, i, layer)
            x_BND, _, _ = layer(x_BND, cos_sin, layer_attend, TRAIN_ACT)
        return x_BND

    def draft_logits(self, hidden_BTD, shared: Shared) -> Float[Array, "b t v"]:
        """Logits (float32) by the target's output head, after the draft's final norm."""
        x = layers.rms_norm(hidden_BTD, self.final_norm[...], self.config.layer.rms_norm_eps)
        head = shared.head.astype(x.dtype)
        return jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)

    def chain(
        self, shared: Shared, h: Float[Array, "*b d"], z_prev: Float[Array, "*b d"], tokens
    ) -> Float[Array, "*b d"]:
        """The chained head's z_k from the block's output h_k, z_{k-1} and the token x_{k-1}
        (module docstring); h_k itself without the chained head."""
        if not self.config.chained:
            return h
        w = lambda p: p[...].astype(self._dtype)
        eps = self.config.layer.rms_norm_eps
        prev = layers.rms_norm(z_prev, self.final_norm[...], eps)
        u = jnp.concatenate([prev, lookup(shared.embed, tokens).astype(self._dtype)], axis=-1)
        return h + jax.nn.silu(u @ w(self.chain_in)) @ w(self.chain_out)

    def _layers(self) -> list[Block]:
        if self.rollout_layers is not None:
            return list(self.rollout_layers)
        graphdef, state = nnx.split(self.layers)
        pick = lambda i: nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        return [pick(i) for i in range(self.num_layers)]

    # -- rollout -------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return draft_cache(self.config.layer, self.mesh, batch, max_len)

    def prefill(
        self, shared, prompt, lengths, root, features: Taps, cache, *, kernels: Kernels = None
    ) -> DraftOut:
        """Slots 0 .. n-1 of a prompt of n tokens: the context of a root at position n."""
        return self.extend(shared, prompt, features, lengths, cache, kernels=kernels)

    def extend(
        self, shared, tokens, features: Taps, count, cache: KVCache, *, kernels: Kernels = None
    ) -> DraftOut:
        """Appends the context of the first `count` features (the target's at the positions
        before `tokens`); no attention runs, the block is drafted from it by `block_hidden`."""
        b, t = tokens.shape
        positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)
        cos_sin = layers.rope_angles(self.config.layer, positions)
        ctx = self.fuse(features)
        kv = [self.context_kv(layer, ctx, cos_sin) for layer in self._layers()]
        k, v = (jnp.stack(x) for x in zip(*kv, strict=True))
        empty = jnp.zeros((b, 0), jnp.float32)
        return DraftOut(empty, empty, cache.append(k, v, count))

    def block_hidden(
        self, shared: Shared, root: Int[Array, " b"], cache: KVCache, *, kernels: Kernels = None
    ) -> Float[Array, "b k d"]:
        """The layers' outputs at the block's positions [B, block_size, D] (the root, at the
        position after the cache's last slot, then the masks), in one forward."""
        b, n = root.shape[0], self.config.block_size
        j = jnp.arange(n, dtype=jnp.int32)
        cos_sin = layers.rope_angles(self.config.layer, cache.length[:, None] + j)
        chain = dict(
            anchor=jnp.broadcast_to((cache.length - 1)[:, None], (b, n)),
            parent=jnp.broadcast_to(j - 1, (b, n)),
            query_nodes=jnp.full((b, n), n - 1, jnp.int32),  # every query sees the whole block
        )
        attend = lambda i, layer, q, k, v: cache_attention(
            cache, i, Branch(q, k, v, **chain), self.mesh, kernels
        )
        x_BND = jnp.swapaxes(self.block_inputs(shared, root), 0, 1)
        return self.forward(x_BND, cos_sin, attend)

    def for_rollout(self) -> BlockDraft:
        """A copy for a loop of rollout steps: the layers sliced out of their stack once, every
        weight in the compute dtype once."""
        draft = nnx.merge(*nnx.split(self))
        draft.rollout_layers = nnx.List(self._layers())
        draft.layers = None
        graphdef, state = nnx.split(draft)
        return nnx.merge(graphdef, layers.rollout_weights(state, self._dtype))

    def check_target(self, target: ModelConfig) -> None:
        check_block_config(self.config, target)

    def check_tree(self, tree: TreeConfig, where: str = "rollout.tree") -> None:
        """Raises ConfigError unless this draft's block is deep enough for `tree`."""
        check_block_tree(tree, self.config.block_size, where)


def create_block(config: BlockConfig, *, mesh: Mesh | None = None, seed: int = 0) -> BlockDraft:
    """A randomly initialised block draft, born sharded over `mesh` (as `models.create`)."""
    make = lambda: BlockDraft(config, rngs=nnx.Rngs(seed), mesh=mesh)
    return create_sharded(make, mesh, (BlockDraft, config, seed))
