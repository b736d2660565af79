"""EAGLE-3 drafts in their public checkpoint layout: import into `Eagle3Draft`, export back.

Two layouts are in use and both load: the EAGLE repo's, whose decoder layer is `midlayer.*`, and
the `speculators` / vLLM one, `layers.0.*`; otherwise the names are shared: `fc` (3H -> H),
`{layer}.input_layernorm` (on the token embedding), `{layer}.hidden_norm` (on the fused feature),
`{layer}.self_attn.{q,k,v,o}_proj` (q/k/v read the 2H-wide concatenation),
`{layer}.post_attention_layernorm`, `{layer}.mlp.{gate,up,down}_proj`, `norm`, `lm_head` (draft
vocabulary), `d2t` (draft id i is target id i + d2t[i]) and `t2d` (a mask over the target
vocabulary). Some drafts also carry `embed_tokens.weight`, a copy of the embedding of the target
they were trained for; jspec drafts read the target's own, so the copy is not loaded into the
draft: `load` returns it and, given the target's embedding, refuses a draft whose copy differs (a
draft trained for another target of the same shape would otherwise load and draft poorly, with no
error). `config.json` is a Llama config with `draft_vocab_size` and
`norm_before_residual` (the layer fields may sit under `transformer_layer_config`).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file

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
# The draft's embedding copy is the target's when every element is within bf16 rounding of it
# (relative 2**-8, doubled: either side may have been rounded, to bf16 or fp16) or both are below
# fp16's normal range, where a stored copy loses relative precision.
EMBED_RTOL, EMBED_ATOL = 2.0**-7, 1e-6
TAPS = "eagle_aux_hidden_state_layer_ids"


class Found(NamedTuple):
    """What `load` found in the checkpoint, so the caller can check it against the target."""

    layout: str  # 'eagle' (midlayer.*) or 'speculators' (layers.0.*)
    norm_before_residual: bool
    embedding: np.ndarray | None  # its own copy of its target's embedding, if it has one

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
    # The target layers whose inputs the draft reads (vLLM's and speculators' name; EAGLE's own
    # checkpoints do not say): taps in jspec's sense, the hidden state entering each layer.
    taps = raw.get(TAPS) or (raw.get("eagle_config") or {}).get(TAPS)
    return Eagle3Config(
        layer=layer_config,
        draft_vocab_size=int(raw["draft_vocab_size"]),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        tap_layers=tuple(int(t) for t in taps) if taps else None,
    )


def config_to_json(config: Eagle3Config, context: int | None = None) -> dict[str, Any]:
    out = hf.config_to_hf(config.layer, context)
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        draft_vocab_size=config.draft_vocab_size,
        norm_before_residual=config.norm_before_residual,
        target_hidden_size=config.layer.hidden_size,
    )
    if config.tap_layers is not None:
        out[TAPS] = list(config.tap_layers)
    return out


def _layout(keys) -> str:
    for name, prefix in LAYOUTS.items():
        if f"{prefix}.self_attn.q_proj.weight" in keys:
            return name
    raise hf.CheckpointError(
        "no decoder layer found: expected midlayer.self_attn.q_proj.weight (EAGLE repo layout) "
        "or layers.0.self_attn.q_proj.weight (speculators layout)."
    )


class _Reader(hf._Reader):
    """The draft's tensors; a missing one is named with the layout found, not with the target
    loader's hint (num_hidden_layers, tie_word_embeddings), which does not apply to a draft."""

    def __init__(self, root: pathlib.Path, config, stack: contextlib.ExitStack):
        super().__init__(root, config, stack)
        self.layout = _layout(self.where)

    def tensor(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.where:
            raise hf.CheckpointError(
                f"tensor {key!r} is missing from the EAGLE-3 draft in {self.root} "
                f"({self.layout} layout: {LAYOUTS[self.layout]}.*, read from {self.source.name}); "
                "the draft's weights are incomplete: re-download or re-export it (hf_eagle3.save "
                "writes every tensor)."
            )
        return super().tensor(key, shape)


def load(
    path: str | pathlib.Path,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    *,
    target_embedding: Any | None = None,
    allow_other_target: bool = False,
    **overrides: Any,
) -> tuple[Eagle3Draft, Found]:
    """An Eagle3Draft from a public EAGLE-3 checkpoint directory, and what was found there.

    `mesh`: parameters placed sharded by their logical axes; `dtype`: parameter and compute dtype
    (None keeps the checkpoint's); `overrides`: other fields of the draft's layer config.
    `target_embedding` [V,D] (the target's, e.g. `target.embed[...]`): a draft carrying its own
    copy that differs from it is refused (`check_embedding`), or loaded with a warning when
    `allow_other_target`; a draft with no copy loads unchecked.
    """
    root = pathlib.Path(path)
    if not (root / hf.CONFIG).is_file():
        raise hf.CheckpointNotFoundError(
            f"{root / hf.CONFIG} not found; point at an EAGLE-3 draft directory (config.json and "
            f"{hf.SINGLE})."
        )
    if dtype is not None:
        overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
    config = config_from_json(hf.read_json(root / hf.CONFIG), **overrides)
    make = lambda: Eagle3Draft(config, rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, state = nnx.split(nnx.eval_shape(make))
    np_dtype = np.dtype(jnp.dtype(config.layer.param_dtype))
    c = config.layer
    with contextlib.ExitStack() as stack:
        reader = _Reader(root, c, stack)
        values: dict[str, Any] = {}
        for (name,), var in nnx.to_flat_state(state):
            if name == "target_ids":
                values[name] = hf.place(_target_ids(reader, config), mesh, var)
                continue
            key, n_in = _KEYS[name]
            key = key.format(layer=LAYOUTS[reader.layout])
            shape = tuple(var.shape)
            host = hf._from_hf(reader.tensor(key, hf._hf_shape(shape, n_in)), shape, n_in)
            values[name] = hf.place(host.astype(np_dtype, copy=False), mesh, var)
        embedding = None
        if EMBED in reader.where:
            embedding = reader.tensor(EMBED, (c.vocab_size, c.hidden_size))
    found = Found(reader.layout, config.norm_before_residual, embedding)
    if target_embedding is not None:
        check_embedding(root, found, target_embedding, allow_other_target=allow_other_target)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state), found


def check_embedding(
    path: str | pathlib.Path,
    found: Found,
    target_embedding: Any,
    *,
    allow_other_target: bool = False,
) -> None:
    """Refuses (CheckpointError) the draft at `path` when its own embedding copy differs from the
    target's beyond bf16 rounding: it was trained for another target, and would load silently
    since their shapes agree. `allow_other_target`: a warning instead. No copy: nothing to check."""
    own = found.embedding
    if own is None:
        return
    target_shape = tuple(np.shape(target_embedding))
    if own.shape != target_shape:
        raise hf.CheckpointError(
            f"the EAGLE-3 draft in {path} carries an embed_tokens.weight of shape {own.shape}, "
            f"but the target's embedding has shape {target_shape}: the draft was trained for "
            "another target; load the draft trained for this target."
        )
    max_diff, rows = _embedding_difference(_like(own, target_embedding), target_embedding)
    if not rows:
        return
    what = (
        f"the EAGLE-3 draft in {path} carries an embed_tokens.weight that differs from the "
        f"target's embedding ({int(rows)} of {own.shape[0]} rows beyond bf16 rounding, max abs "
        f"difference {float(max_diff):.3g}): it was trained for another target"
    )
    if not allow_other_target:
        raise hf.CheckpointError(
            f"{what}; load the draft trained for this target, or set "
            "rollout.draft.allow_other_target=true (allow_other_target=True in hf_eagle3.load) to "
            "load it anyway."
        )
    warnings.warn(f"{what}; loading it anyway (allow_other_target).", stacklevel=2)


@jax.jit
def _embedding_difference(own, target):
    """The largest |own - target| and the number of rows with an element beyond bf16 rounding,
    in float32, on the devices holding the target's embedding (no host copy of it)."""
    a, b = own.astype(jnp.float32), target.astype(jnp.float32)
    diff = jnp.abs(a - b)
    off = diff > EMBED_ATOL + EMBED_RTOL * jnp.maximum(jnp.abs(a), jnp.abs(b))
    return diff.max(), off.any(axis=1).sum()


def _like(host: np.ndarray, target) -> Any:
    """`host` placed as the array `target` is (each device receives its own slice only)."""
    if not isinstance(target, jax.Array):
        return host
    return jax.make_array_from_callback(host.shape, target.sharding, lambda i: host[i])


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


def save(
    path: str | pathlib.Path,
    draft: Eagle3Draft,
    *,
    layout: str = "eagle",
    embedding: Any | None = None,
    context: int | None = None,
) -> None:
    """Writes the draft in the public layout (`layout` 'eagle' or 'speculators'), loadable by
    `load` and by engines that serve EAGLE-3 drafts; `embedding` [V,D] (the target's) is written
    as `embed_tokens.weight` for engines that want the draft to carry it; `context` as in
    `hf.save`. Every process gathers
    the weights (a collective: all call it) and process 0 writes, as `hf.save`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}.")
    config = draft.config
    tensors: dict[str, np.ndarray] = {}
    for (name,), var in nnx.to_flat_state(nnx.state(draft, nnx.Param)):
        key, n_in = _KEYS[name]
        tensors[key.format(layer=LAYOUTS[layout])] = hf._to_hf(hf.host_array(var[...]), n_in)
    ids = hf.host_array(draft.target_ids[...]).astype(np.int64)
    tensors["d2t"] = ids - np.arange(ids.size)
    t2d = np.zeros(config.layer.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embedding is not None:
        tensors[EMBED] = np.ascontiguousarray(hf.host_array(embedding))
    if jax.process_index() != 0:
        return
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / hf.CONFIG).write_text(json.dumps(config_to_json(config, context), indent=2) + "\n")
    save_file(tensors, root / hf.SINGLE, metadata={"format": "pt"})
