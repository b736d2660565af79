"""Block drafts in DFlash's public layout (github.com/z-lab/dflash, `DFlashDraftModel`), read and
written as far as that layout maps onto `jspec.models.block.BlockDraft`.

The layout: config.json is a Qwen3 config of the draft's layers (`num_hidden_layers` of them) with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config`
{`block_size`, `target_layer_ids`, `mask_token_id`}; the tensors are `fc.weight` [D, n * D],
`hidden_norm.weight`, `layers.{i}.*` under Qwen3's layer names (`input_layernorm`,
`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`) and `norm.weight`. How it maps:
- DFlash reads the *outputs* of the target layers `target_layer_ids` (Hugging Face's
  `hidden_states[l + 1]`), jspec's taps are layer *inputs*: the output of layer l is the input of
  layer l + 1, so the target's taps must be [l + 1 for l in target_layer_ids], three of them.
  Another count (the one published config read here, z-lab/dflash's DFlash2 test fixture, taps
  five layers) or other taps are refused, naming them and the `model.tap_layers` that serve.
- DFlash's mask is the target's embedding row `mask_token_id`; jspec's is the draft's own vector,
  written as `mask_embedding` (a tensor DFlash's code does not read), and read from there, or else
  from that row of the target's embedding.
- jspec's chained head (`BlockConfig.chained`) is written as `chain_in.weight` and
  `chain_out.weight` with `chained_head: true` in config.json; DFlash's code knows neither.
- Anything else is refused by name: tensors this draft does not hold (DFlash2's convolutions and
  candidate selector, attention biases), sliding-window or causal layers, and logit scaling.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file

from jspec.config import ModelConfig
from jspec.models import hf
from jspec.models.block import BlockConfig, BlockDraft

ARCHITECTURE = "DFlashDraftModel"
MASK = "mask_embedding"
CHAINED = "chained_head"
_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("fc",): ("fc.weight", 1),
    ("hidden_norm",): ("hidden_norm.weight", None),
    ("mask",): (MASK, None),
    ("final_norm",): ("norm.weight", None),
    ("chain_in",): ("chain_in.weight", 1),
    ("chain_out",): ("chain_out.weight", 1),
    **{
        ("layers", *path): (key.removeprefix("model."), n_in)
        for path, (key, n_in) in hf._LAYER_KEYS.items()
        if path[0] != "moe"
    },
}
# dflash_config fields of other models' drafts that this draft does not compute, and the values
# that leave the logits as they are (which load).
_NEUTRAL = {
    "input_embedding_scale": (None, 1.0),
    "output_multiplier": (None, 1.0),
    "final_logit_softcapping": (None, 0.0),
}


def config_from_json(hf_config: dict[str, Any], target: ModelConfig, root="") -> BlockConfig:
    """The BlockConfig of a DFlash config.json for `target` (in the target's dtypes), or a
    CheckpointError naming what does not map (module docstring)."""
    if ARCHITECTURE not in (hf_config.get("architectures") or []):
        raise hf.CheckpointError(
            f"{root} is not a DFlash draft: config.json's architectures are "
            f"{hf_config.get('architectures')}, not [{ARCHITECTURE!r}]."
        )
    dflash = hf_config.get("dflash_config") or {}
    odd = [n for n, ok in _NEUTRAL.items() if dflash.get(n, hf_config.get(n)) not in ok]
    if hf_config.get("is_causal") or "sliding_attention" in (hf_config.get("layer_types") or ()):
        odd.append("is_causal/layer_types")
    if odd:
        raise hf.CheckpointError(
            f"the DFlash draft at {root} sets {odd}, which jspec's block draft does not compute "
            "(bidirectional blocks over the whole context, unscaled logits only)."
        )
    layer = hf.config_from_hf({**hf_config, "architectures": ["Qwen3ForCausalLM"]})
    fields = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    fields += ("vocab_size", "rope_theta", "rope_scaling", "rms_norm_eps")
    differ = [
        f"{n}={getattr(layer, n)!r}" for n in fields if getattr(layer, n) != getattr(target, n)
    ]
    if differ:
        raise hf.CheckpointError(
            f"the DFlash draft at {root} differs from the target in {differ}: it shares the "
            "target's layer shape, embedding and output head; use a draft made for this target."
        )
    ids = list(dflash.get("target_layer_ids") or [])
    taps = tuple(i + 1 for i in ids)
    if len(ids) != 3 or taps != target.taps:
        raise hf.CheckpointError(
            f"the DFlash draft at {root} reads the outputs of target layers {ids} (the inputs of "
            f"layers {list(taps)}), the target gives the inputs of layers {list(target.taps)}: "
            "jspec targets tap three layers; set model.tap_layers to the draft's, or use a draft "
            "of three target layers."
        )
    size = int(dflash.get("block_size", hf_config.get("block_size", 16)))
    chained = bool(hf_config.get(CHAINED, False))
    return BlockConfig.for_target(target, size, num_layers=layer.num_layers, chained=chained)


def load(
    path: str | pathlib.Path,
    target: ModelConfig,
    *,
    mesh: Mesh | None = None,
    target_embedding: jax.Array | None = None,
) -> BlockDraft:
    """The DFlash draft in `path` as a `BlockDraft` for `target`, placed by its logical axes on
    `mesh`; its mask from `mask_embedding`, or else the row `mask_token_id` of
    `target_embedding` (the target's [V, D])."""
    root = pathlib.Path(path)
    hf_config = hf.read_json(root / hf.CONFIG)
    config = config_from_json(hf_config, target, root)
    make = lambda: BlockDraft(config, rngs=nnx.Rngs(0), mesh=mesh)  # shapes only
    graphdef, state = nnx.split(nnx.eval_shape(make))
    flat = {}
    with contextlib.ExitStack() as stack:
        reader = hf._Reader(root, config.layer, stack)
        _check_tensors(root, set(reader.where), config)
        for keys, var in nnx.to_flat_state(state):
            if keys == ("mask",) and MASK not in reader.where:
                host = _mask_row(root, hf_config, target_embedding)
            else:
                host = _read(reader, keys, tuple(var.shape))
            host = host.astype(np.dtype(target.param_dtype), copy=False)
            flat[keys] = hf.place(host, mesh, var)
    return hf.merge_flat(graphdef, state, flat)


def _read(reader, keys: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The parameter at `keys` in jspec's layout (a layer stack: one tensor per layer)."""
    key, n_in = _KEYS[keys]
    one = shape[1:] if keys[0] == "layers" else shape
    read = lambda k: hf._from_hf(reader.tensor(k, hf._hf_shape(one, n_in)), one, n_in)
    if keys[0] != "layers":
        return read(key)
    return np.stack([read(key.format(i=i)) for i in range(shape[0])])


def _mask_row(root, hf_config: dict[str, Any], target_embedding) -> np.ndarray:
    token = (hf_config.get("dflash_config") or {}).get("mask_token_id")
    if token is None or target_embedding is None:
        raise hf.CheckpointError(
            f"the DFlash draft at {root} has no {MASK} tensor; its mask is the target's embedding "
            f"of dflash_config.mask_token_id ({token}): pass the target's embedding "
            "(target_embedding=) and a config.json that names the token."
        )
    return hf.host_array(target_embedding[int(token)])


def _check_tensors(root: pathlib.Path, found: set[str], config: BlockConfig) -> None:
    """Refuses tensors this draft does not hold, naming them."""
    known = {MASK} | {
        key.format(i=i) for key, _ in _KEYS.values() for i in range(config.layer.num_layers)
    }
    if not config.chained:
        known -= {"chain_in.weight", "chain_out.weight"}
    if unknown := sorted(found - known):
        raise hf.CheckpointError(
            f"the DFlash draft at {root} has tensors jspec's block draft does not hold: "
            f"{unknown[:6]} (DFlash2's convolutions and candidate selector, or biases)."
        )


def save(
    path: str | pathlib.Path, draft: BlockDraft, target: ModelConfig, context: int | None = None
) -> None:
    """Writes the draft of `target` in DFlash's layout (config.json, model.safetensors with
    `mask_embedding`); `context` as in `hf.save`. Every process gathers the weights (a
    collective: all call it); process 0 writes."""
    tensors = {}
    for keys, var in nnx.to_flat_state(nnx.state(draft, nnx.Param)):
        key, n_in = _KEYS[keys]
        host = hf.host_array(var[...])
        if keys[0] == "layers":
            tensors.update({key.format(i=i): hf._to_hf(w, n_in) for i, w in enumerate(host)})
        else:
            tensors[key] = hf._to_hf(host, n_in)
    if jax.process_index() != 0:
        return
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    size = draft.config.block_size
    dflash = {
        "block_size": size,
        "target_layer_ids": [t - 1 for t in target.taps],
        "mask_token_id": None,  # the mask is `mask_embedding`
    }
    config = {
        **hf.config_to_hf(draft.config.layer, context),
        "architectures": [ARCHITECTURE],
        "block_size": size,
        "num_target_layers": target.num_layers,
        "dflash_config": dflash,
        **({CHAINED: True} if draft.config.chained else {}),
    }
    (root / hf.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, root / hf.SINGLE, metadata={"format": "pt"})
