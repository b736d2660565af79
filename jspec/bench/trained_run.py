"""A run directory of `jspec.jobs.train_code_lm`, as the benchmarks read it: its target, the draft
of one kind (a run directory may hold an EAGLE-3 draft, an MTP head and block drafts, with and
without the chained head, of one target), held-out prompts, and where that draft came from (its
steps, training seconds and held-out agreement), which every speedup is quoted with.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jspec.config import ConfigError
from jspec.models import hf, hf_block, hf_eagle3, hf_mtp
from jspec.tokenizers import HFTokenizer

DRAFT_DIRS = {"eagle3": "draft", "mtp": "mtp", "block": "block", "block-chained": "block-chained"}


def _report(run: pathlib.Path) -> dict:
    return json.loads((run / "report.json").read_text())


def draft_kind(run: pathlib.Path, asked: str | None) -> str:
    """The draft kind to run: `asked`, else the one the run directory's latest run trained; an
    error when it holds no draft of that kind."""
    kind = asked or _report(run)["args"].get("draft_kind", "eagle3")
    if not (run / DRAFT_DIRS[kind]).is_dir():
        held = [k for k, d in DRAFT_DIRS.items() if (run / d).is_dir()]
        raise ConfigError(
            f"--draft-kind {kind}: {run} holds no {kind} draft ({run / DRAFT_DIRS[kind]}); it "
            f"holds {', '.join(held) or 'none'}: train one with `python -m "
            f"jspec.jobs.train_code_lm --run-dir {run} --draft-kind {kind}`."
        )
    return kind


def provenance(run: pathlib.Path, kind: str) -> dict:
    """Where the `kind` draft of `run` came from: its steps, training seconds and held-out top-1
    agreement (None where a report written before drafts were kept by kind does not say)."""
    report = _report(run)
    latest = report["args"].get("draft_kind", "eagle3")
    unknown = dict(draft_steps=None, draft_seconds=None, draft_top1_agreement=None)
    if latest == kind:  # a report of one draft, the latest run's
        unknown = dict(
            unknown,
            draft_steps=report["args"]["draft_steps"],
            draft_top1_agreement=report["draft_top1_agreement"],
        )
    trained = {**unknown, **report.get("drafts", {}).get(kind, {})}
    agreement = trained["draft_top1_agreement"]
    return dict(
        draft="trained offline by jspec.jobs.train_code_lm",
        draft_kind=kind,
        draft_steps=trained["draft_steps"],
        draft_seconds=trained["draft_seconds"],
        draft_top1_agreement=None if agreement is None else round(agreement, 3),
    )


def load(run: pathlib.Path, kind: str, prompt_len: int, count: int, dtype: str = "bfloat16"):
    """(target, draft of `kind`, prompts) in `dtype`: the prompts are the first `prompt_len`
    tokens of each held-out file that has that many, at most `count`."""
    target = hf.load(run / "target", dtype=dtype)
    if kind == "mtp":  # the head beside the target, in MiMo's layout
        draft = hf_mtp.load(run / "mtp", target.config)
    elif kind.startswith("block"):  # DFlash's layout
        path = run / DRAFT_DIRS[kind]
        draft = hf_block.load(path, target.config, target_embedding=target.embed[...])
    else:
        draft, _ = hf_eagle3.load(run / "draft", dtype=dtype)
    tok = HFTokenizer(run / "tokenizer.json", _report(run)["eos_token"])
    texts = json.loads((run / "heldout.json").read_text())
    prompts = [ids[:prompt_len] for ids in map(tok.encode, texts)]
    prompts = [p for p in prompts if len(p) == prompt_len][:count]
    if not prompts:
        raise SystemExit(f"no held-out file of {prompt_len} tokens; lower --prompt-len")
    return target, draft, np.asarray(prompts)
