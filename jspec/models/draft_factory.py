"""The draft a `DraftConfig` describes, for a target: loaded from its checkpoint (EAGLE-3's public
layout, an MTP head in MiMo's layout beside its policy, a block draft in DFlash's, or a Hugging
Face decoder for an external draft) or initialised randomly, and checked against the target. It
sits apart from `draft` (the models) because the loaders import those."""

from __future__ import annotations

import pathlib

from jax.sharding import Mesh

from jspec.config import DraftConfig, ModelConfig
from jspec.models import hf, hf_block, hf_eagle3, hf_mtp
from jspec.models.block import BlockConfig, create_block
from jspec.models.draft import (
    Eagle3Config,
    ExternalDraft,
    check_eagle3_config,
    check_target,
    create_eagle3,
)
from jspec.models.mtp import MTPConfig, create_mtp
from jspec.models.transformer import Transformer, create

# ModelConfig fields a loaded draft takes from the target it serves, not from its checkpoint: it
# computes (dtype), is stored (param_dtype) and rematerialises (remat) as a fresh draft would.
RUN_FIELDS = ("dtype", "param_dtype", "remat")


def check_config(config: DraftConfig, target: ModelConfig) -> None:
    """Raises ConfigError when the draft `config` describes cannot serve `target`, from configs
    alone (a checkpoint's config.json, not its weights): before anything is built."""
    config.validate()
    if config.kind == "mtp" and config.path is not None:
        hf.check_config(config.path, target)  # a head serves the trunk it was trained with
    if config.kind in ("eagle3", "block") and config.path is not None:
        path = pathlib.Path(config.path)
        if not (path / hf.CONFIG).is_file():
            what = {"eagle3": "an EAGLE-3 draft", "block": "a block draft in DFlash's layout"}
            run_dir = {"eagle3": "RUN/draft", "block": "RUN/block"}
            raise hf.CheckpointNotFoundError(
                f"rollout.draft.path={config.path!r} holds no {hf.CONFIG}; point at "
                f"{what[config.kind]} (config.json and model.safetensors, e.g. train_code_lm's "
                f"{run_dir[config.kind]}), or leave it unset for a fresh draft."
            )
        hf_config = hf.read_json(path / hf.CONFIG)
        if config.kind == "block":
            hf_block.config_from_json(hf_config, target, path)
        else:
            check_eagle3_config(hf_eagle3.config_from_json(hf_config), target)


def from_config(config, target: Transformer, *, mesh: Mesh | None = None, seed: int = 0):
    """The draft `config` (a `DraftConfig`) describes for `target`, checked against it; None for
    kind 'none'. Loads `config.path` when given (an EAGLE-3 draft carrying an embedding copy other
    than the target's is refused unless `config.allow_other_target`) in the target's RUN_FIELDS,
    else initialises randomly."""
    config.validate()
    if config.kind == "none":
        return None
    run = {name: getattr(target.config, name) for name in RUN_FIELDS}
    if config.kind == "eagle3":
        if config.path is not None:
            draft, _ = hf_eagle3.load(
                config.path,
                mesh=mesh,
                target_embedding=target.embed[...],
                allow_other_target=config.allow_other_target,
                **run,
            )
        else:
            layer = Eagle3Config.for_target(target.config, config.vocab_size)
            draft = create_eagle3(layer, mesh=mesh, seed=seed)
    elif config.kind == "mtp":
        draft = (
            hf_mtp.load(config.path, target.config, mesh)
            if config.path is not None
            else create_mtp(MTPConfig.for_target(target.config), mesh=mesh, seed=seed)
        )
    elif config.kind == "block" and config.path is not None:
        draft = hf_block.load(
            config.path, target.config, mesh=mesh, target_embedding=target.embed[...]
        )
    elif config.kind == "block":
        block = BlockConfig.for_target(
            target.config, config.block_size, config.block_layers, config.block_chained
        )
        draft = create_block(block, mesh=mesh, seed=seed)
    elif config.path is not None:
        draft = ExternalDraft(hf.load(config.path, mesh=mesh, **run))
    else:
        draft = ExternalDraft(create(config.model, mesh=mesh, seed=seed))
    check_target(draft, target.config)
    return draft
