"""Configs: frozen dataclasses, loaded from YAML, overridden by dotted `key=value` arguments.

One `Config` describes a run: the model, the mesh it runs on, and what the run does with it. Every
field is validated once, in Python, before anything is traced or compiled, and every error names
the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


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

    `tap_layers` are the layers whose *input* hidden states the draft consumes (EAGLE-3 takes the
    inputs of layers 2, L//2 and L-3); None means that default.

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
        return (2, n // 2, n - 3)

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
        if s is not None and s.high_freq_factor <= s.low_freq_factor:
            raise ConfigError(
                f"{where}.rope_scaling.high_freq_factor={s.high_freq_factor} must exceed "
                f"low_freq_factor={s.low_freq_factor} (Llama 3 uses 4.0 and 1.0)."
            )
        taps = self.taps
        bad = [t for t in taps if not 0 <= t < self.num_layers]
        if bad or len(set(taps)) != len(taps):
            raise ConfigError(
                f"{where}.tap_layers={taps} must be distinct layer indices in "
                f"[0, {self.num_layers}); the EAGLE-3 default (2, L//2, L-3) needs num_layers >= 6,"
                f" or set {where}.tap_layers explicitly."
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


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; -1 on one axis means 'all devices left over'."""

    data: int = -1
    stage: int = 1
    context: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    name: str = "tiny"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()

    def validate(self) -> Config:
        self.model.validate("model")
        return self


# ---------------------------------------------------------------------------------------------
# Loading and overrides.


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: Any, where: str) -> Any:
    """Builds dataclass `cls` from a nested dict, checking names and coercing scalar types."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of fields, got {data!r}.")
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(types_), n=1)
        prefix = f"{where}." if where else ""
        hint = f"; did you mean {prefix}{close[0]}?" if close else "."
        raise ConfigError(
            f"unknown config field {prefix}{name}{hint} Known fields: {', '.join(types_)}."
        )
    kwargs = {
        name: _coerce(types_[name], value, f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, Sequence):
            raise ConfigError(f"{where}={value!r} must be a list.")
        (elem, *_) = typing.get_args(tp)
        return tuple(_coerce(elem, v, where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{where}={value!r} is not a boolean; use true or false.")
    if tp in (int, float):
        try:
            out = tp(value) if tp is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} is not {tp.__name__}.") from None
        return out
    if tp is str:
        return str(value)
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is a value, not a section.")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> dict:
    """Turns `["model.num_layers=4", "seed=1"]` into a nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} has no '='; write overrides as dotted.key=value, "
                "e.g. model.num_layers=4."
            )
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """A config name (`tiny`) found in `configs/`, or a path to a YAML file."""
    path = pathlib.Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"config {str(name_or_path)!r} not found at {path}; pass a YAML path or one of: "
            f"{', '.join(known)}."
        )
    return path


def load(name_or_path: str | pathlib.Path = "tiny", overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config, applies dotted overrides, validates, and returns a frozen Config."""
    path = resolve_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("name", path.stem)
    data = _merge(data, parse_overrides(overrides))
    return _build(Config, data, "").validate()


def to_dict(config: Any) -> dict:
    """The plain nested dict of a config (for logs, checkpoints and YAML)."""
    return dataclasses.asdict(config)
