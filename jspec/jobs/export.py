"""A policy and its draft in the layouts that `transformers` and serving engines load: the policy
in the Hugging Face layout with its tokenizer, an EAGLE-3 draft in the public layout, a block draft
in DFlash's (`jspec.models.hf_block`), an MTP head beside the policy in MiMo's
(`jspec.models.hf_mtp`)."""

from __future__ import annotations

import pathlib
import shutil

from jspec import hosts, tokenizers
from jspec.models import hf, hf_block, hf_eagle3, hf_mtp
from jspec.models.block import BlockDraft
from jspec.models.mtp import MTPDraft


def save_for_serving(
    policy, draft, tokenizer, directory: pathlib.Path, source: str | None = None
) -> None:
    """`policy` in `directory`/policy (with `tokenizer` when it is a tokenizer.json's) and `draft`
    (None: none) in `directory`/draft or beside the policy; written beside and then moved into
    place, so a half-written export is never read. `source`: the checkpoint the policy started
    from (None: random weights), whose context (`hf.trained_context`) the config.json files
    keep. Every process takes part (on many hosts the weights are gathered); process 0 writes the
    files."""
    staged = directory.with_name(directory.name + ".partial")
    if hosts.is_main():
        shutil.rmtree(staged, ignore_errors=True)
    context = hf.trained_context(source, policy.config)
    hf.save(staged / "policy", policy, context=context)
    if isinstance(draft, MTPDraft):
        hf_mtp.save(staged / "policy", draft)
    elif isinstance(draft, BlockDraft):
        hf_block.save(staged / "draft", draft, policy.config, context)
    elif draft is not None:
        hf_eagle3.save(staged / "draft", draft, context=context)
    if hosts.is_main():
        if isinstance(tokenizer, tokenizers.HFTokenizer):
            tokenizer.save(staged / "policy")
        shutil.rmtree(directory, ignore_errors=True)
        staged.rename(directory)
