"""The draft a `DraftConfig` describes, for a target: loaded from its checkpoint (EAGLE-3's public
layout, or a Hugging Face decoder for an external draft) or initialised randomly, and checked
against the target. It sits apart from `draft` (the models) because the loaders import those."""

from __future__ import annotations

from jax.sharding import Mesh

from jspec.models import hf, hf_eagle3
from jspec.models.draft import Eagle3Config, ExternalDraft, check_target, create_eagle3
from jspec.models.transformer import Transformer, create


def from_config(config, target: Transformer, *, mesh: Mesh | None = None, seed: int = 0):
    """The draft `config` (a `DraftConfig`) describes for `target`, checked against it; None for
    kind 'none'. Loads `config.path` when given (an EAGLE-3 draft carrying an embedding copy other
    than the target's is refused unless `config.allow_other_target`), else initialises randomly."""
    config.validate()
    if config.kind == "none":
        return None
    if config.kind == "eagle3":
        if config.path is not None:
            draft, _ = hf_eagle3.load(
                config.path,
                mesh=mesh,
                target_embedding=target.embed[...],
                allow_other_target=config.allow_other_target,
            )
        else:
            layer = Eagle3Config.for_target(target.config, config.vocab_size)
            draft = create_eagle3(layer, mesh=mesh, seed=seed)
    elif config.path is not None:
        draft = ExternalDraft(hf.load(config.path, mesh=mesh))
    else:
        draft = ExternalDraft(create(config.model, mesh=mesh, seed=seed))
    check_target(draft, target.config)
    return draft
