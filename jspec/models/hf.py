"""Hugging Face checkpoints (safetensors; Llama 3, Qwen3, Qwen3-MoE): import into jspec, export.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Loading reads one tensor at a time with safetensors' numpy
framework, stacks the layers, and places each parameter straight onto its sharding
(`jax.make_array_from_callback`: every device receives only its own slice, read from the tensors
of its layers and experts alone); the host holds one device's slice of one parameter at a time
(the experts of a 235B-A22B layer stack are 150 GB), and no device ever holds a full copy of a
sharded one.

Layout: Hugging Face linear weights are [out, in]; jspec keeps them [in, out] with heads split out
(`wq [D,H,E]`, `wo [H,E,D]`), and stacks layers on a leading axis (dense-MLP and sparse layers in
their own stacks: `transformer.layer_stacks`). Qwen3-MoE experts are one tensor per expert in the
checkpoint (`mlp.experts.{e}.gate_proj.weight`, as published and as `transformers` writes them)
and stacked on the axis after the layers in jspec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jspec import mesh as mesh_lib
from jspec.config import ConfigError, ModelConfig, RopeScaling
from jspec.models.transformer import Transformer, layer_stacks

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# jspec parameter path -> (Hugging Face key, number of leading jspec axes that form HF's "in" axis;
# None: same layout). In `_LAYER_KEYS` the path is inside a decoder stack, "{i}" is the layer (the
# stack's leading axis) and "{e}" the expert (the next axis).
_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("embed",): ("model.embed_tokens.weight", None),
    ("final_norm",): ("model.norm.weight", None),
    ("unembed",): ("lm_head.weight", None),
}
_LAYER_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("attn_norm",): ("model.layers.{i}.input_layernorm.weight", None),
    ("wq",): ("model.layers.{i}.self_attn.q_proj.weight", 1),
    ("wk",): ("model.layers.{i}.self_attn.k_proj.weight", 1),
    ("wv",): ("model.layers.{i}.self_attn.v_proj.weight", 1),
    ("wo",): ("model.layers.{i}.self_attn.o_proj.weight", 2),
    ("q_norm",): ("model.layers.{i}.self_attn.q_norm.weight", None),
    ("k_norm",): ("model.layers.{i}.self_attn.k_norm.weight", None),
    ("mlp_norm",): ("model.layers.{i}.post_attention_layernorm.weight", None),
    ("w_gate",): ("model.layers.{i}.mlp.gate_proj.weight", 1),
    ("w_up",): ("model.layers.{i}.mlp.up_proj.weight", 1),
    ("w_down",): ("model.layers.{i}.mlp.down_proj.weight", 1),
    ("moe", "router"): ("model.layers.{i}.mlp.gate.weight", 1),
    ("moe", "w_gate"): ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", 1),
    ("moe", "w_up"): ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", 1),
    ("moe", "w_down"): ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", 1),
}
# Qwen3-MoE config.json fields that are ModelConfig fields of the same name.
_MOE_FIELDS = (
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "router_aux_loss_coef",
)


class CheckpointError(ConfigError):
    """A checkpoint jspec cannot read as it is; the message names the culprit and the fix."""


class CheckpointNotFoundError(ConfigError, FileNotFoundError):
    """A file of the checkpoint directory is missing; the message names the path."""


def read_json(path: pathlib.Path) -> dict:
    """The JSON file `path` of a checkpoint; a CheckpointError naming it when it does not parse."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error}); restore the file from the checkpoint's source."
        ) from None


# ---------------------------------------------------------------------------------------------
# Configs.


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict; `overrides` replace ModelConfig fields
    (e.g. `tap_layers`, `remat`, `param_dtype`)."""
    arch = _architecture(hf)
    unsupported = {
        "attention_bias": True,
        "mlp_bias": True,
        "use_sliding_window": True,
    }
    for key, bad in unsupported.items():
        if hf.get(key) == bad:
            raise CheckpointError(
                f"config.json sets {key}={bad}, which jspec's {arch} does not implement; only "
                f"checkpoints with {key}=false load."
            )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json sets hidden_act={hf['hidden_act']!r}; jspec's SwiGLU MLP needs 'silu'."
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "llama3":
        names = [f.name for f in dataclasses.fields(RopeScaling)]
        scaling = RopeScaling(**{n: rope[n] for n in names if n in rope})
    elif rope_type == "default":
        scaling = None
    else:
        raise CheckpointError(
            f"config.json asks for rope_type={rope_type!r}; jspec supports 'default' and 'llama3'."
        )
    moe = {}
    if SUPPORTED[arch] == "qwen3_moe":
        moe = {name: hf[name] for name in _MOE_FIELDS if name in hf}
        # transformers 5 writes num_experts as num_local_experts
        moe["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", 128))
        moe["mlp_only_layers"] = tuple(hf.get("mlp_only_layers") or ())
    try:
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        config = ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=SUPPORTED[arch] in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
            param_dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
            **moe,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required field {e.args[0]!r}.") from None
    return dataclasses.replace(config, **overrides)


# ModelConfig fields a run chooses for itself, whatever the checkpoint: how it computes, how long
# its sequences are, what it taps, how it weights the load-balancing loss.
RUN_FIELDS = ("dtype", "param_dtype", "remat", "tap_layers", "max_seq_len", "router_aux_loss_coef")


def trained_context(source: str | pathlib.Path | None, config: ModelConfig) -> int:
    """The context a model's weights are good for: the longer of its run's max_seq_len and the
    max_position_embeddings of the checkpoint `source` (a model or run directory; None: none) it
    started from."""
    if source is None:
        return config.max_seq_len
    theirs = read_json(model_directory(source) / CONFIG).get("max_position_embeddings") or 0
    return max(theirs, config.max_seq_len)


def model_directory(path: str | pathlib.Path) -> pathlib.Path:
    """The Hugging Face model directory at `path`, or the target/ of a `train_code_lm` run
    directory `path`."""
    root = pathlib.Path(path)
    for candidate in (root, root / "target"):
        if (candidate / CONFIG).is_file():
            return candidate
    raise CheckpointNotFoundError(
        f"{root / CONFIG} not found; point at a Hugging Face checkpoint directory ({CONFIG}, "
        f"{SINGLE} or {INDEX}, tokenizer.json) or a train_code_lm run directory (its target/)."
    )


def check_config(path: str | pathlib.Path, config: ModelConfig, where: str = "model") -> None:
    """Raises CheckpointError naming every field but RUN_FIELDS in which `config` differs from
    the config.json of the checkpoint at `path`: its weights would not fit, or not mean the same."""
    root = pathlib.Path(path)
    theirs = config_from_hf(read_json(root / CONFIG))
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUN_FIELDS]
    differ = [n for n in fields if getattr(config, n) != getattr(theirs, n)]
    if differ:
        listed = ", ".join(
            f"{where}.{n}={getattr(config, n)!r} (the checkpoint's {getattr(theirs, n)!r})"
            for n in differ
        )
        raise CheckpointError(
            f"the checkpoint {root} is another model than the config's: {listed}; set these "
            f"fields to the checkpoint's (or use a config written for it), or point at another "
            "checkpoint."
        )


def config_to_hf(config: ModelConfig, context: int | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of a ModelConfig (Qwen3-MoE iff it has experts, else
    Qwen3 iff qk_norm, else Llama); `context`: its max_position_embeddings (None: max_seq_len)."""
    c = config
    model_type = "qwen3_moe" if c.num_experts else "qwen3" if c.qk_norm else "llama"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta}
        rope.update(dataclasses.asdict(c.rope_scaling))
    moe = {}
    if c.num_experts:
        moe = {name: getattr(c, name) for name in ("num_experts", *_MOE_FIELDS)}
        moe["mlp_only_layers"] = list(c.mlp_only_layers)
    return {
        "architectures": [{t: a for a, t in SUPPORTED.items()}[model_type]],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context or c.max_seq_len,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "rope_parameters": rope,
        "dtype": c.param_dtype,
        # The same again in the transformers-4 layout, which vLLM, SGLang and older readers use.
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else rope,
        "torch_dtype": c.param_dtype,
        **moe,
    }


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    by_type = {t: a for a, t in SUPPORTED.items()}
    for name in names:
        if name in SUPPORTED:
            return name
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    found = names or [f"model_type={hf.get('model_type')!r}"]
    raise CheckpointError(
        f"architecture {', '.join(found)} is not supported; jspec loads "
        f"{' and '.join(SUPPORTED)} checkpoints (config.json 'architectures')."
    )


# ---------------------------------------------------------------------------------------------
# Layout conversion.


def _tensors(
    path: tuple[str, ...], config: ModelConfig
) -> tuple[list[tuple[str, tuple]], int | None]:
    """The Hugging Face tensors of the jspec parameter at `path`: (key, index of the key's slice
    of the stacked jspec array) pairs, and the parameter's `n_in`."""
    stacks = layer_stacks(config)
    if path[0] not in stacks:
        key, n_in = _KEYS[path]
        return [(key, ())], n_in
    key, n_in = _LAYER_KEYS[path[1:]]
    out = [(key, ())]
    for name, ids in (("{i}", stacks[path[0]]), ("{e}", range(config.num_experts))):
        if name in key:
            out = [(k.replace(name, str(v)), at + (j,)) for k, at in out for j, v in enumerate(ids)]
    return out, n_in


def _from_hf(w: np.ndarray, shape: tuple[int, ...], n_in: int | None) -> np.ndarray:
    return w if n_in is None else w.T.reshape(shape)


def _to_hf(w: np.ndarray, n_in: int | None) -> np.ndarray:
    if n_in is None:
        return np.ascontiguousarray(w)
    return np.ascontiguousarray(w.reshape(math.prod(w.shape[:n_in]), -1).T)


def _hf_shape(shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    return shape if n_in is None else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


# ---------------------------------------------------------------------------------------------
# Import.


def open_weights(path: pathlib.Path):
    """safetensors' reader of `path` (a context manager); a CheckpointError naming the file when it
    is not a whole safetensors file (a copy cut short, another format)."""
    try:
        return safe_open(path, framework="np")
    except SafetensorError as error:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({error}); it may have been cut short: "
            "copy or export the checkpoint again."
        ) from None


class _Reader:
    """The checkpoint's tensors by key, across its safetensors files (opened on first use)."""

    def __init__(self, root: pathlib.Path, config: ModelConfig, stack: contextlib.ExitStack):
        self.root, self.config, self.stack, self.files = root, config, stack, {}
        if (root / INDEX).is_file():
            self.where = read_json(root / INDEX)["weight_map"]
            self.source = root / INDEX
        elif (root / SINGLE).is_file():
            self.where = dict.fromkeys(self._open(SINGLE).keys(), SINGLE)
            self.source = root / SINGLE
        else:
            raise CheckpointNotFoundError(
                f"no weights in {root}: neither {root / SINGLE} nor {root / INDEX} exists; point "
                "at a Hugging Face checkpoint directory (save_pretrained writes one)."
            )

    def _open(self, name: str):
        if name not in self.files:
            path = self.root / name
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path} (listed in {self.root / INDEX}) not found.")
            self.files[name] = self.stack.enter_context(open_weights(path))
        return self.files[name]

    def tensor(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `key`, checked to have `shape` (in the Hugging Face layout)."""
        if key not in self.where:
            raise CheckpointError(
                f"tensor {key!r} is missing from {self.source}; the checkpoint does not match "
                f"its config.json (num_hidden_layers={self.config.num_layers}, "
                f"tie_word_embeddings={self.config.tie_embeddings}): fix config.json or re-export."
            )
        w = self._open(self.where[key]).get_tensor(key)
        if tuple(w.shape) != shape:
            raise CheckpointError(
                f"tensor {key!r} in {self.root / self.where[key]} has shape {tuple(w.shape)}, but "
                f"config.json implies {shape}; the weights and config.json disagree."
            )
        return w

    def param(self, path: tuple[str, ...], shape: tuple[int, ...], dtype, index=()) -> np.ndarray:
        """The slice `index` (slices, leading axes; default all) of the jspec parameter at `path`
        in jspec layout, reading only the per-layer and per-expert tensors that the slice covers."""
        keys, n_in = _tensors(path, self.config)
        stacked = len(keys[0][1])  # leading axes that enumerate tensors (layers, experts)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        kept = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
        out = np.empty([len(r) for r in kept], dtype)
        one = shape[stacked:]
        for key, at in keys:
            if all(i in r for i, r in zip(at, kept[:stacked], strict=True)):
                w = _from_hf(self.tensor(key, _hf_shape(one, n_in)), one, n_in)
                out[tuple(r.index(i) for i, r in zip(at, kept, strict=False))] = w[index[stacked:]]
        return out


def load(
    path: str | pathlib.Path,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    *,
    config: ModelConfig | None = None,
    **overrides: Any,
) -> Transformer:
    """A Transformer from a Hugging Face checkpoint directory.

    `mesh`: parameters are placed sharded by their logical axes as they load. `dtype`: parameter
    and compute dtype ('float32', 'bfloat16', 'float16'; None keeps the checkpoint's). `overrides`:
    other ModelConfig fields (e.g. `tap_layers=(1, 2, 3)`, `remat='dots'`). `config`: a run's whole
    model config instead (checked against the checkpoint's by `check_config`).
    """
    root = pathlib.Path(path)
    if not (root / CONFIG).is_file():
        raise CheckpointNotFoundError(
            f"{root / CONFIG} not found; point at a Hugging Face checkpoint directory (it holds "
            f"{CONFIG} and {SINGLE} or {INDEX})."
        )
    if config is not None:
        check_config(root, config)
    else:
        if dtype is not None:
            overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
        config = config_from_hf(read_json(root / CONFIG), **overrides)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, state = nnx.split(abstract)
    np_dtype = np.dtype(jnp.dtype(config.param_dtype))
    flat = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(root, config, stack)
        for keys, var in nnx.to_flat_state(state):
            shape = tuple(var.shape)
            if mesh is None:
                array = jax.device_put(reader.param(keys, shape, np_dtype))
            else:  # each device receives its own slice only
                read = lambda i, keys=keys, shape=shape: reader.param(keys, shape, np_dtype, i)
                array = jax.make_array_from_callback(shape, mesh_lib.sharding(mesh, var.axes), read)
            flat[keys] = array
    return merge_flat(graphdef, state, flat)


# ---------------------------------------------------------------------------------------------
# Export.


def merge_flat(graphdef, state, flat: dict):
    """The module of `graphdef` whose parameters are `flat`, keyed by the paths that
    `nnx.to_flat_state(state)` names (a loader reads them one by one)."""
    values: dict = {}
    for keys, array in flat.items():
        node = values
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = array
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def place(host: np.ndarray, mesh: Mesh | None, var) -> jax.Array:
    """A host array on the device (no mesh), or placed by the logical axes of the parameter `var`
    it fills, each device receiving its own slice only."""
    if mesh is None:
        return jax.device_put(host)
    sharding = mesh_lib.sharding(mesh, var.axes)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def host_array(x: Any) -> np.ndarray:
    """The whole value of `x` on this host, gathered from every process when it spans several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save(
    path: str | pathlib.Path,
    model: Transformer,
    *,
    max_shard_bytes: int | None = None,
    context: int | None = None,
) -> None:
    """Writes `config.json` and the weights in the Hugging Face layout, loadable by `transformers`.

    `context`: the config's max_position_embeddings (None: the model's max_seq_len;
    `trained_context` gives it for a model that started from a checkpoint).
    With `max_shard_bytes`, weights larger than that are split into numbered shard files plus
    `model.safetensors.index.json`. Every process gathers each whole parameter (`host_array`: a
    collective, so all call it) and process 0 writes; the model must fit in one host's memory.
    """
    tensors: dict[str, np.ndarray] = {}
    for param, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        host = host_array(var[...])
        keys, n_in = _tensors(param, model.config)
        tensors.update({key: _to_hf(host[at], n_in) for key, at in keys})
    if jax.process_index() != 0:
        return
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(model.config, context)
    (root / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    total = sum(w.nbytes for w in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, root / SINGLE, metadata=meta)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    for key, w in tensors.items():
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + w.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][key] = w
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, root / name, metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
