"""The jitted speculative sampler: the sampling transform, draft trees, lossless verification,
and `generate`.

`jspec.sampler.verify` is the contract's function (docs/sampler.md); it lives in
`jspec.sampler.acceptance`, and `generate` in `jspec.sampler.generation`: the modules to patch in
tests.
"""

from jspec.sampler.acceptance import Verdict, emitted_tokens, verify
from jspec.sampler.arguments import Continued
from jspec.sampler.generation import compile_generate, generate, rollout
from jspec.sampler.results import Rollout, RolloutStats
from jspec.sampler.sampling import (
    sample,
    sample_from_probs,
    sample_without_replacement,
    sampling_probs,
)
from jspec.sampler.tree import (
    BranchLayout,
    DynamicTreeState,
    Frontier,
    StaticTree,
    Tree,
    branch_layout,
    build_dynamic_tree,
    build_sampled_dynamic_tree,
    build_static_tree,
    dynamic_tree_finish,
    dynamic_tree_init,
    dynamic_tree_step,
)

__all__ = [
    "BranchLayout",
    "Continued",
    "DynamicTreeState",
    "Frontier",
    "Rollout",
    "RolloutStats",
    "StaticTree",
    "Tree",
    "Verdict",
    "branch_layout",
    "build_dynamic_tree",
    "build_sampled_dynamic_tree",
    "build_static_tree",
    "compile_generate",
    "dynamic_tree_finish",
    "dynamic_tree_init",
    "dynamic_tree_step",
    "emitted_tokens",
    "generate",
    "sample",
    "sample_from_probs",
    "sample_without_replacement",
    "rollout",
    "sampling_probs",
    "verify",
]
