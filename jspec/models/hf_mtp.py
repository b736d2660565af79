"""MTP heads in MiMo's public layout, in the policy's own Hugging Face directory: a policy ships
its head beside its trunk.

Tensors of head i (jspec drafts with one, i = 0): `model.mtp_layers.{i}.hidden_layernorm`,
`.token_layernorm`, `.input_proj` ([D, 2D], reading [hidden, token]), the decoder layer under the
trunk's own names (`.input_layernorm`, `.self_attn.{q,k,v,o}_proj`, `.self_attn.{q,k}_norm` for
a Qwen3-style trunk, `.post_attention_layernorm`, `.mlp.{gate,up,down}_proj`) and
`.final_layernorm`; config.json's `num_nextn_predict_layers` counts the heads. `save` writes them
to their own file (`MTP_FILE`) listed with the trunk's in `model.safetensors.index.json`, so
`hf.load` and `transformers` still read the trunk, and engines that serve MTP heads find them.
A checkpoint whose head is in another layout (DeepSeek-V3's extra decoder layer: `eh_proj`,
`enorm`, `hnorm`) or has tensors this head does not hold (attention biases) is refused with the
names found.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file

from jspec.config import ModelConfig
from jspec.models import hf
from jspec.models.mtp import MTPConfig, MTPDraft

PREFIX = "model.mtp_layers.{index}"
MTP_FILE = "model-mtp.safetensors"
COUNT = "num_nextn_predict_layers"
_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("hidden_norm",): ("hidden_layernorm.weight", None),
    ("token_norm",): ("token_layernorm.weight", None),
    ("input_proj",): ("input_proj.weight", 1),
    ("final_norm",): ("final_layernorm.weight", None),
    **{
        ("block", *path): (key.removeprefix("model.layers.{i}."), n_in)
        for path, (key, n_in) in hf._LAYER_KEYS.items()
        if path[0] != "moe"
    },
}
# Names of the heads of other layouts, refused with what was found.
_OTHER_LAYOUTS = re.compile(r"(^|\.)(eh_proj|enorm|hnorm|shared_head)\.|mtp")


class _Reader(hf._Reader):
    """The head's tensors; a missing one is named as the head's, not with the trunk loader's hint
    (num_hidden_layers, tie_word_embeddings), which does not apply to a head."""

    def tensor(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.where:
            raise hf.CheckpointError(
                f"tensor {key!r} of the MTP head is missing from {self.source}: the head's weights "
                "are incomplete; re-export the policy with its head (hf_mtp.save writes every "
                "tensor)."
            )
        return super().tensor(key, shape)


def _key(path: tuple[str, ...], index: int) -> tuple[str, int | None]:
    key, n_in = _KEYS[path]
    return f"{PREFIX.format(index=index)}.{key}", n_in


def load(
    path: str | pathlib.Path,
    target: ModelConfig,
    mesh: Mesh | None = None,
    *,
    index: int = 0,
) -> MTPDraft:
    """Head `index` of the policy directory `path` as an `MTPDraft` for `target` (its layer
    config: the target's, in the target's dtypes), placed by its logical axes on `mesh`."""
    root = pathlib.Path(path)
    config = MTPConfig.for_target(target)
    make = lambda: MTPDraft(config, rngs=nnx.Rngs(0), mesh=mesh)  # shapes only
    graphdef, state = nnx.split(nnx.eval_shape(make))
    np_dtype = np.dtype(target.param_dtype)
    flat = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(root, target, stack)
        _check_layout(root, reader.where, index, state)
        for keys, var in nnx.to_flat_state(state):
            key, n_in = _key(keys, index)
            shape = tuple(var.shape)
            one = shape[1:] if keys[0] == "block" else shape  # the block's one-layer stack
            host = hf._from_hf(reader.tensor(key, hf._hf_shape(one, n_in)), one, n_in)
            host = host.reshape(shape).astype(np_dtype, copy=False)
            flat[keys] = hf.place(host, mesh, var)
    return hf.merge_flat(graphdef, state, flat)


def _check_layout(root: pathlib.Path, keys, index: int, state) -> None:
    """Refuses a checkpoint with no head `index` in this layout, or with tensors of that head
    this layout does not know, naming what it found."""
    prefix = PREFIX.format(index=index) + "."
    own = {k for k in keys if k.startswith(prefix)}
    if not own:
        other = sorted(k for k in keys if _OTHER_LAYOUTS.search(k))
        found = f"; MTP-like tensors found: {other[:6]}" if other else ""
        raise hf.CheckpointError(
            f"no MTP head {index} in {root}: no tensor named {prefix}* (MiMo's layout){found}. "
            "Load a policy exported with its head, or draft with a fresh head (leave "
            "rollout.draft.path unset)."
        )
    known = {_key(keys_, index)[0] for keys_, _ in nnx.to_flat_state(state)}
    if unknown := sorted(own - known):
        raise hf.CheckpointError(
            f"the MTP head {index} in {root} has tensors this head does not hold: {unknown[:6]} "
            "(attention biases or another decoder layer); only heads whose layer is the trunk's "
            "own kind load."
        )


def save(path: str | pathlib.Path, draft: MTPDraft, *, index: int = 0) -> None:
    """Adds head `index` to the policy directory `path` (written by `hf.save` first): its tensors
    in `MTP_FILE`, listed with the trunk's in the index, and `num_nextn_predict_layers` in
    config.json. Every process gathers the weights (a collective: all call it); process 0
    writes."""
    tensors = {}
    for keys, var in nnx.to_flat_state(nnx.state(draft, nnx.Param)):
        key, n_in = _key(keys, index)
        host = hf.host_array(var[...])
        tensors[key] = hf._to_hf(host[0] if keys[0] == "block" else host, n_in)
    if jax.process_index() != 0:
        return
    root = pathlib.Path(path)
    if not (root / hf.CONFIG).is_file():
        raise hf.CheckpointNotFoundError(
            f"{root / hf.CONFIG} not found: save the policy there first (hf.save), then its head."
        )
    save_file(tensors, root / MTP_FILE, metadata={"format": "pt"})
    weight_map = _weight_map(root)
    weight_map = {k: f for k, f in weight_map.items() if f != MTP_FILE or k in tensors}
    weight_map.update(dict.fromkeys(tensors, MTP_FILE))
    total = sum((root / f).stat().st_size for f in set(weight_map.values()))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / hf.INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    config = hf.read_json(root / hf.CONFIG)
    config[COUNT] = max(int(config.get(COUNT, 0)), index + 1)
    (root / hf.CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _weight_map(root: pathlib.Path) -> dict[str, str]:
    """Every tensor of the directory and its file: the index's, or the single file's."""
    if (root / hf.INDEX).is_file():
        return dict(hf.read_json(root / hf.INDEX)["weight_map"])
    with hf.open_weights(root / hf.SINGLE) as f:
        return dict.fromkeys(f.keys(), hf.SINGLE)
