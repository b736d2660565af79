"""EAGLE-3 drafts in their public checkpoint layout: import into `Eagle3Draft`, export back.

Two layouts are in use and both load: the EAGLE repo's, whose decoder layer is `midlayer.*`, and
the `speculators` / vLLM one, `layers.0.*`; otherwise the names are shared: `fc` (3H -> H),
`{layer}.input_layernorm` (on the token embedding), `{layer}.hidden_norm` (on the fused feature),
`{layer}.self_attn.{q,k,v,o}_proj` (q/k/v read the 2H-wide concatenation),
`{layer}.post_attention_layernorm`, `{layer}.mlp.{gate,up,down}_proj`, `norm`, `lm_head` (draft
vocabulary), `d2t` (draft id i is target id i + d2t[i]) and `t2d` (a mask over the target
vocabulary). Some drafts also carry `embed_tokens.weight`, a copy of the target's embedding; jspec
drafts read the target's own, so the copy is returned for the caller to use or compare, not
loaded into the draft. `config.json` is a Llama config with `draft_vocab_size` and
`norm_before_residual` (the layer fields may sit under `transformer_layer_config`).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file

from jspec import mesh as mesh_lib
from jspec.models import hf
from jspec.models.draft import Eagle3Config, Eagle3Draft

LAYOUTS = {"eagle": "midlayer", "speculators": "layers.0"}

# jspec parameter -> (public key, "{layer}" for the decoder layer's prefix; leading jspec axes
# forming the public "in" axis, None: same layout).
_KEYS: dict[str, tuple[str, int | None]] = {
    "fc": ("fc.weight", 1),
    "input_norm": ("{layer}.input_layernorm.weight", None),
    "hidden_norm": ("{layer}.hidden_norm.weight", None),
    "wq": ("{layer}.self_attn.q_proj.weight", 1),
    "wk": ("{layer}.self_attn.k_proj.weight", 1),
    "wv": ("{layer}.self_attn.v_proj.weight", 1),
    "wo": ("{layer}.self_attn.o_proj.weight", 2),
    "mlp_norm": ("{layer}.post_attention_layernorm.weight", None),
    "w_gate": ("{layer}.mlp.gate_proj.weight", 1),
    "w_up": ("{layer}.mlp.up_proj.weight", 1),
    "w_down": ("{layer}.mlp.down_proj.weight", 1),
    "final_norm": ("norm.weight", None),
    "lm_head": ("lm_head.weight", None),
}
EMBED = "embed_tokens.weight"


class Found(NamedTuple):
    """What `load` found in the checkpoint, so the caller can check it against the target."""

    layout: str  # 'eagle' (midlayer.*) or 'speculators' (layers.0.*)
    norm_before_residual: bool
    embedding: np.ndarray | None  # the draft's own copy of the target embedding, if it has one

    def describe(self) -> str:
        emb = "its own embed_tokens copy" if self.embedding is not None else "no embed_tokens"
        return (
            f"EAGLE-3 draft, {self.layout} layout ({LAYOUTS[self.layout]}.*), "
            f"norm_before_residual={self.norm_before_residual}, {emb}"
        )


def config_from_json(raw: dict[str, Any], **overrides: Any) -> Eagle3Config:
    """The Eagle3Config of a public draft's `config.json`; `overrides` replace layer fields."""
    layer = dict(raw.get("transformer_layer_config") or raw)
    layer["architectures"] = ["LlamaForCausalLM"]
    if "draft_vocab_size" not in raw:
        raise hf.CheckpointError(
            "config.json has no draft_vocab_size: not an EAGLE-3 draft config (load a target "
            "model with jspec.models.hf.load)."
        )
    layer_config = hf.config_from_hf(layer, **overrides)
    return Eagle3Config(
        layer=layer_config,
        draft_vocab_size=int(raw["draft_vocab_size"]),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def config_to_json(config: Eagle3Config) -> dict[str, Any]:
    out = hf.config_to_hf(config.layer)
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        draft_vocab_size=config.draft_vocab_size,
        norm_before_residual=config.norm_before_residual,
        target_hidden_size=config.layer.hidden_size,
    )
    return out


def _layout(keys) -> str:
    for name, prefix in LAYOUTS.items():
        if f"{prefix}.self_attn.q_proj.weight" in keys:
            return name
    raise hf.CheckpointError(
        "no decoder layer found: expected midlayer.self_attn.q_proj.weight (EAGLE repo layout) "
        "or layers.0.self_attn.q_proj.weight (speculators layout)."
    )


def load(
    path: str | pathlib.Path, mesh: Mesh | None = None, dtype: str | None = None, **overrides: Any
) -> tuple[Eagle3Draft, Found]:
    """An Eagle3Draft from a public EAGLE-3 checkpoint directory, and what was found there.

    `mesh`: parameters placed sharded by their logical axes; `dtype`: parameter and compute dtype
    (None keeps the checkpoint's); `overrides`: other fields of the draft's layer config.
    """
    root = pathlib.Path(path)
    if not (root / hf.CONFIG).is_file():
        raise hf.CheckpointNotFoundError(
            f"{root / hf.CONFIG} not found; point at an EAGLE-3 draft directory (config.json and "
            f"{hf.SINGLE})."
        )
    if dtype is not None:
        overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
    config = config_from_json(json.loads((root / hf.CONFIG).read_text()), **overrides)
    make = lambda: Eagle3Draft(config, rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, state = nnx.split(nnx.eval_shape(make))
    np_dtype = np.dtype(jnp.dtype(config.layer.param_dtype))
    c = config.layer
    with contextlib.ExitStack() as stack:
        reader = hf._Reader(root, c, stack)
        layout = _layout(reader.where)
        values: dict[str, Any] = {}
        for (name,), var in nnx.to_flat_state(state):
            if name == "target_ids":
                values[name] = _place(_target_ids(reader, config), mesh, var)
                continue
            key, n_in = _KEYS[name]
            key = key.format(layer=LAYOUTS[layout])
            shape = tuple(var.shape)
            host = hf._from_hf(reader.tensor(key, hf._hf_shape(shape, n_in)), shape, n_in)
            values[name] = _place(host.astype(np_dtype, copy=False), mesh, var)
        embedding = None
        if EMBED in reader.where:
            embedding = reader.tensor(EMBED, (c.vocab_size, c.hidden_size))
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state), Found(layout, config.norm_before_residual, embedding)


def _target_ids(reader, config: Eagle3Config) -> np.ndarray:
    """d2t offsets -> target ids, checked against t2d."""
    n, v = config.draft_vocab_size, config.layer.vocab_size
    ids = np.arange(n) + reader.tensor("d2t", (n,)).astype(np.int64)
    if ids.min() < 0 or ids.max() >= v or np.unique(ids).size != n:
        raise hf.CheckpointError(
            f"d2t maps draft ids outside the target vocabulary [0, {v}) or onto one target id "
            "twice; the draft's d2t does not fit its config.json vocab_size."
        )
    if "t2d" in reader.where:
        t2d = reader.tensor("t2d", (v,)).astype(bool)
        if t2d.sum() != n or not t2d[ids].all():
            raise hf.CheckpointError("t2d and d2t disagree on which target tokens are drafted.")
    return ids.astype(np.int32)


def _place(host: np.ndarray, mesh: Mesh | None, var) -> jax.Array:
    if mesh is None:
        return jax.device_put(host)
    sharding = mesh_lib.sharding(mesh, var.axes)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def save(
    path: str | pathlib.Path,
    draft: Eagle3Draft,
    *,
    layout: str = "eagle",
    embedding: Any | None = None,
) -> None:
    """Writes the draft in the public layout (`layout` 'eagle' or 'speculators'), loadable by
    `load` and by engines that serve EAGLE-3 drafts; `embedding` [V,D] (the target's) is written
    as `embed_tokens.weight` for engines that want the draft to carry it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}.")
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = draft.config
    tensors: dict[str, np.ndarray] = {}
    for (name,), var in nnx.to_flat_state(nnx.state(draft, nnx.Param)):
        key, n_in = _KEYS[name]
        host = np.asarray(jax.device_get(var[...]))
        tensors[key.format(layer=LAYOUTS[layout])] = hf._to_hf(host, n_in)
    ids = np.asarray(jax.device_get(draft.target_ids[...])).astype(np.int64)
    tensors["d2t"] = ids - np.arange(ids.size)
    t2d = np.zeros(config.layer.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embedding is not None:
        tensors[EMBED] = np.ascontiguousarray(np.asarray(jax.device_get(embedding)))
    (root / hf.CONFIG).write_text(json.dumps(config_to_json(config), indent=2) + "\n")
    save_file(tensors, root / hf.SINGLE, metadata={"format": "pt"})
