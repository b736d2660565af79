"""A multi-token-prediction (MTP) head as a draft: the module that policies such as DeepSeek-V3,
GLM-4.5 and MiMo ship beside their trunk, applied recurrently to propose chains and trees.

At position i the module reads the target's final-normed hidden state (what the target's output
head reads: its `features="final"`, no taps) and the embedding of token i + 1, normalises each
(`hidden_norm`, `token_norm`), projects their concatenation [hidden, token] from 2D to D
(`input_proj`), runs one decoder layer of the target's own kind, normalises (`final_norm`) and
predicts token i + 2 with the target's output head. Embedding and head are the target's, passed in
at every call (`Shared`), never copied. The normalised output has the role of the target's hidden
state one position on, so it is the feature of the next depth: one module drafts a chain by
recurrence (as MiMo runs its first MTP layer), and a tree level is one application over the
level's nodes. Its vocabulary is the target's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float

from jspec import mesh as mesh_lib
from jspec.config import ConfigError, ModelConfig
from jspec.models import layers
from jspec.models.draft import OneLayerDraft, Shared, TargetVocabulary
from jspec.models.transformer import TRAIN_ACT, Block, create_sharded


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """An MTP head: `layer` is the shape of its one decoder layer, the target's kind of layer
    (its q/k norms included), with the target's vocabulary and RoPE."""

    layer: ModelConfig

    @classmethod
    def for_target(cls, target: ModelConfig) -> MTPConfig:
        """The head a target ships: one layer of the target's own shape, dense."""
        layer = dataclasses.replace(
            target, num_layers=1, tap_layers=None, num_experts=0, mlp_only_layers=()
        )
        return cls(layer=layer)

    def validate(self) -> None:
        self.layer.validate("draft")
        if self.layer.num_layers != 1:
            raise ConfigError(
                f"an MTP head applied recurrently has one decoder layer, not "
                f"{self.layer.num_layers}."
            )


def check_mtp_config(c: MTPConfig, target: ModelConfig) -> None:
    """Raises ConfigError when an MTP head of config `c` cannot serve this target: it reads the
    target's hidden states and shares its embedding and output head."""
    for name in ("hidden_size", "vocab_size"):
        if getattr(c.layer, name) != getattr(target, name):
            raise ConfigError(
                f"the MTP head's {name}={getattr(c.layer, name)} differs from the target's "
                f"{getattr(target, name)}: the head reads the target's hidden states and shares "
                "its embedding and output head; use a head trained with this target."
            )


class MTPDraft(TargetVocabulary, OneLayerDraft):
    """The MTP head (module docstring). Parameters carry logical axis names like the target's;
    the decoder layer is a `Block` of one layer, the target's own layer code."""

    features = "final"

    def __init__(self, config: MTPConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        config.validate()
        c = config.layer
        d = c.hidden_size
        p = functools.partial(layers.init_param, rngs, dtype=jnp.dtype(c.param_dtype))
        self.config, self.mesh = config, mesh
        self.hidden_norm = p((d,), ("norm",), fan_in=None)
        self.token_norm = p((d,), ("norm",), fan_in=None)
        self.input_proj = p((2 * d, d), (None, "embed"), fan_in=2 * d)
        self.block = Block(c, 1, rngs=rngs)
        self.final_norm = p((d,), ("norm",), fan_in=None)
        self.rollout_block = nnx.data(None)  # set by `for_rollout`: the layer, products fused

    def fuse(self, features: Float[Array, "1 b t d"]) -> Float[Array, "b t d"]:
        """The target's one feature, its final-normed hidden state, in the compute dtype."""
        return features[0].astype(self._dtype)

    def layer(self, emb_BTD, hidden_BTD, cos_sin, attend):
        """The module: returns its normalised output (the next depth's feature) and the rotated
        (k, v) [B,T,K,E] of its decoder layer (None where `attend` wrote them:
        `CacheWriter.layer`)."""
        eps = self.config.layer.rms_norm_eps
        w = lambda p: p[...].astype(self._dtype)
        x_BT2D = jnp.concatenate(
            [
                layers.rms_norm(hidden_BTD.astype(self._dtype), self.hidden_norm[...], eps),
                layers.rms_norm(emb_BTD.astype(self._dtype), self.token_norm[...], eps),
            ],
            axis=-1,
        )
        x_BTD = jnp.einsum("btf,fd->btd", x_BT2D, w(self.input_proj))
        block = self.rollout_block
        if block is None:  # the one layer, sliced out of its stack (as `Transformer._layers`)
            graphdef, state = nnx.split(self.block)
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
        x_BTD, kv, _ = block(x_BTD, cos_sin, attend, TRAIN_ACT)
        return layers.rms_norm(x_BTD, self.final_norm[...], eps), kv

    def draft_logits(self, hidden_BTD, shared: Shared) -> Float[Array, "b t v"]:
        """Logits (float32) by the target's output head: the output is normalised already."""
        head = shared.head.astype(hidden_BTD.dtype)
        return jnp.einsum("btd,vd->btv", hidden_BTD, head, preferred_element_type=jnp.float32)

    def check_target(self, target: ModelConfig) -> None:
        check_mtp_config(self.config, target)

    def for_rollout(self) -> MTPDraft:
        """A copy for a loop of rollout steps: the decoder layer sliced out of its stack once,
        its products fused (`Block.fused`), every weight in the compute dtype once."""
        constrain = lambda x, names: mesh_lib.constrain(x, self.mesh, names)
        graphdef, state = nnx.split(self.block)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state)).fused(constrain)
        draft = nnx.merge(*nnx.split(self))
        draft.block, draft.rollout_block = None, block
        graphdef, state = nnx.split(draft)
        return nnx.merge(graphdef, layers.rollout_weights(state, self._dtype))


def create_mtp(config: MTPConfig, *, mesh: Mesh | None = None, seed: int = 0) -> MTPDraft:
    """A randomly initialised MTP head, born sharded over `mesh` (as `models.create`)."""
    make = lambda: MTPDraft(config, rngs=nnx.Rngs(seed), mesh=mesh)
    return create_sharded(make, mesh, (MTPDraft, config, seed))
