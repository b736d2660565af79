"""Speculative decoding: the sampling transform, draft trees, and lossless verification.

`jspec.spec.verify` stays the module (so it can be imported and patched by its dotted name); the
function is `jspec.spec.verify.verify`.
"""

from jspec.spec.sampling import sample, sample_from_probs, sampling_probs
from jspec.spec.tree import (
    BranchLayout,
    DynamicTreeState,
    Frontier,
    StaticTree,
    Tree,
    branch_layout,
    build_dynamic_tree,
    build_static_tree,
    dynamic_tree_finish,
    dynamic_tree_init,
    dynamic_tree_step,
)
from jspec.spec.verify import Verdict, emitted_tokens

__all__ = [
    "BranchLayout",
    "DynamicTreeState",
    "Frontier",
    "StaticTree",
    "Tree",
    "Verdict",
    "branch_layout",
    "build_dynamic_tree",
    "build_static_tree",
    "dynamic_tree_finish",
    "dynamic_tree_init",
    "dynamic_tree_step",
    "emitted_tokens",
    "sample",
    "sample_from_probs",
    "sampling_probs",
]
