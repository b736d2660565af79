"""Packed, load-balanced zigzag ring attention with fused branch (tree) attention.

Depends on jax (and jaxtyping) alone, so it can be lifted out as a library. The contract (names,
shapes, visibility rules, index spaces) is in docs/attention.md; `reference_attention` states it
densely.
"""

from jspec.attention.attend import attention, ring_attention
from jspec.attention.branch import Branch
from jspec.attention.parallel import context_parallel_attention
from jspec.attention.reference import reference_attention
from jspec.attention.ring import SAVED
from jspec.attention.zigzag import zigzag_shard, zigzag_unshard

__all__ = [
    "SAVED",
    "Branch",
    "attention",
    "context_parallel_attention",
    "reference_attention",
    "ring_attention",
    "zigzag_shard",
    "zigzag_unshard",
]
