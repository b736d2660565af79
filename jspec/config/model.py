"""The model's config: a decoder-only LM of the Llama 3 / Qwen3 / Qwen3-MoE families."""

from __future__ import annotations

import dataclasses
import math

from jspec.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM of the Llama 3 / Qwen3 / Qwen3-MoE families.

    `tap_layers` are the layers whose *input* hidden states an EAGLE-3 draft consumes; None means
    the EAGLE-3 default, the inputs of layers 2, L//2 and L-3, or (0, L//2, L-1) for models of 3 to
    6 layers, where that default would repeat a layer. Only a model with a draft attached needs
    them (`check_taps`), so any layer count loads.

    Mixture of experts (Qwen3-MoE; `num_experts=0` is a dense model): layer i has a sparse MLP of
    `num_experts` experts of width `moe_intermediate_size`, each token routed to
    `num_experts_per_tok` of them, iff `i not in mlp_only_layers` and `(i + 1) %
    decoder_sparse_step == 0` (as `transformers` decides); other layers keep the dense MLP of width
    `intermediate_size`. `norm_topk_prob` renormalises the chosen experts' router probabilities to
    sum to 1. `router_aux_loss_coef` is the weight the training loss gives the load-balancing loss.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    tap_layers: tuple[int, ...] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "full"
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the mixture of experts."""
        return tuple(
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def taps(self) -> tuple[int, ...]:
        if self.tap_layers is not None:
            return tuple(self.tap_layers)
        n = self.num_layers
        return (2, n // 2, n - 3) if n >= 7 else (0, n // 2, n - 1)

    def check_taps(self, where: str = "model") -> None:
        """Three distinct tap layers in range: what an EAGLE-3 draft needs of its target."""
        taps = self.taps
        bad = [t for t in taps if not 0 <= t < self.num_layers]
        if len(taps) != 3 or bad or len(set(taps)) != 3:
            raise ConfigError(
                f"{where}.tap_layers={taps}: an EAGLE-3 draft needs 3 distinct layer indices in "
                f"[0, {self.num_layers}); "
                + (
                    f"a model of {self.num_layers} layers has fewer than 3, so use another draft "
                    "kind (external) or none."
                    if self.num_layers < 3
                    else f"set {where}.tap_layers explicitly, or leave it unset for the default."
                )
            )

    def validate(self, where: str = "model") -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{where}.{name}={value} must be positive.")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"{where}.{name}={value} must be a finite number > 0 (Qwen3: rope_theta 1e6, "
                    "rms_norm_eps 1e-6)."
                )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{where}.num_heads={self.num_heads} is not a multiple of "
                f"{where}.num_kv_heads={self.num_kv_heads}; grouped-query attention needs "
                "num_heads = k * num_kv_heads."
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"{where}.head_dim={self.head_dim} must be even: rotary embeddings rotate pairs."
            )
        s = self.rope_scaling
        if (
            s is not None
            and not min(s.factor, s.low_freq_factor, s.original_max_position_embeddings) > 0
        ):
            raise ConfigError(
                f"{where}.rope_scaling={s}: factor, low_freq_factor and "
                "original_max_position_embeddings must be > 0 (Llama 3.1: 8.0, 1.0, 8192)."
            )
        if s is not None and s.high_freq_factor <= s.low_freq_factor:
            raise ConfigError(
                f"{where}.rope_scaling.high_freq_factor={s.high_freq_factor} must exceed "
                f"low_freq_factor={s.low_freq_factor} (Llama 3 uses 4.0 and 1.0)."
            )
        taps = self.tap_layers or ()
        if any(not 0 <= t < self.num_layers for t in taps) or len(set(taps)) != len(taps):
            raise ConfigError(
                f"{where}.tap_layers={self.tap_layers} must be distinct layer indices in "
                f"[0, {self.num_layers})."
            )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16", "float16"):
                raise ConfigError(
                    f"{where}.{name}={value!r} is not one of 'float32', 'bfloat16', 'float16'."
                )
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"{where}.remat={self.remat!r} is not one of 'none', 'full', 'dots'.")
        self._validate_experts(where)

    def _validate_experts(self, where: str) -> None:
        if self.num_experts < 0:
            raise ConfigError(
                f"{where}.num_experts={self.num_experts} must be 0 (a dense model) or positive."
            )
        if self.decoder_sparse_step < 1:
            raise ConfigError(
                f"{where}.decoder_sparse_step={self.decoder_sparse_step} must be at least 1 (1: "
                "every layer not in mlp_only_layers is sparse; 2: every second one)."
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(
                f"{where}.mlp_only_layers={self.mlp_only_layers} names layers {bad} outside "
                f"[0, {self.num_layers}); list indices of dense layers of this model."
            )
        if self.router_aux_loss_coef < 0:
            raise ConfigError(
                f"{where}.router_aux_loss_coef={self.router_aux_loss_coef} must be non-negative "
                "(Qwen3-MoE uses 0.001)."
            )
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{where}.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"{where}.num_experts={self.num_experts}."
            )
        if self.moe_intermediate_size <= 0:
            raise ConfigError(
                f"{where}.moe_intermediate_size={self.moe_intermediate_size} must be positive "
                f"when {where}.num_experts={self.num_experts}: it is the width of each expert's "
                "MLP (Qwen3-30B-A3B uses 768)."
            )
