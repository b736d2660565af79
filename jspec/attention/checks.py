"""Input checks in the caller's terms: the argument's name, the shapes it was given, the fix.

Shapes, dtypes and types are checked always (they are static); index values (anchor, parent,
query_nodes) when they are concrete, i.e. outside `jit`, before anything is compiled. Under `jit`
the values are abstract and go unchecked.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.attention.branch import Branch
from jspec.attention.zigzag import concrete


def _layout_hint(name: str, x, t: int) -> str:
    """A hint when x looks like [B,H,T,D] (heads before tokens) for a row of t tokens."""
    if x.ndim == 4 and x.shape[2] == t and x.shape[1] != t:
        return (
            f" {name} {x.shape} looks like [B,H,T,D]: jspec.attention takes [B,T,H,D], so pass "
            f"jnp.swapaxes({name}, 1, 2)."
        )
    return ""


def _check_ids(name: str, x, dims: str, shape) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} must be {dims}={shape}; got {x.shape}.")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{name} must be integers (int32); got {x.dtype}. Segment ids number the documents "
            f"of a row (0 is padding) and positions restart at 0 in each: pass "
            f"{name}.astype(jnp.int32) if the values are right."
        )


def _check_index(name: str, x, lo, hi, rule: str) -> None:
    """Every x[b, i] in [lo, hi) (hi may be an array over i); names the first one that is not."""
    x = np.asarray(x)
    bad = np.argwhere((x < lo) | (x >= hi))
    if len(bad):
        row, i = (int(j) for j in bad[0])
        raise ValueError(f"{name}[{row}, {i}] = {x[row, i]}: {rule}")


def check_branch_values(branch: Branch, tk: int) -> None:
    """Anchors in the trunk, parents earlier in the same row (so no cycles), query nodes real."""
    n = branch.anchor.shape[1]
    if concrete(branch.anchor):
        _check_index(
            "branch.anchor",
            branch.anchor,
            -1,
            tk,
            f"an anchor is the index of a trunk key token of the same row (0..{tk - 1}), or -1 "
            "for a padding node.",
        )
    if concrete(branch.parent):
        _check_index(
            "branch.parent",
            branch.parent,
            -1,
            np.arange(n),
            "a parent is the index of an earlier node of the same row, or -1 (none); order the "
            "nodes so that every parent comes before its children.",
        )
    if branch.query_nodes is not None and concrete(branch.query_nodes):
        _check_index(
            "branch.query_nodes",
            branch.query_nodes,
            0,
            n,
            f"each branch query belongs to a node of the same row (0..{n - 1}).",
        )


def check_tile_sizes(**sizes: int | None) -> None:
    """Each tile size (`block_q`, `block_k`) positive, or None for the default."""
    for name, size in sizes.items():
        if size is not None and not size > 0:
            raise ValueError(f"{name}={size!r} must be a positive tile size, or None (default).")


def check_inputs(q, k, v, segment_ids, positions, q_segment_ids, q_positions, branch, impl, impls):
    """Every argument of `attention` (and of the ring functions, on the arrays they are given)."""
    if impl not in impls:
        raise ValueError(f"impl={impl!r} is not available; choose one of {impls}.")
    if q is None and branch is None:
        raise ValueError("nothing to attend: q is None and there is no branch.")
    if branch is not None and not isinstance(branch, Branch):
        raise TypeError(
            f"branch must be a jspec.attention.Branch; got {type(branch).__name__}. Build it with "
            "Branch(q, k, v, anchor, parent) (and query_nodes= if queries are not one per node)."
        )
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids must be [B,Tk]; got {segment_ids.shape}.")
    b, tk = segment_ids.shape
    if k.ndim != 4 or k.shape[:2] != (b, tk) or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [B,Tk,Hkv,D] with [B,Tk]={(b, tk)} from segment_ids; got k "
            f"{k.shape}, v {v.shape}." + _layout_hint("k", k, tk)
        )
    _check_ids("segment_ids", segment_ids, "[B,Tk]", (b, tk))
    _check_ids("positions", positions, "[B,Tk]", (b, tk))
    hkv, d = k.shape[2:]
    if (q_segment_ids is None) != (q_positions is None):
        raise ValueError("pass q_segment_ids and q_positions together, or neither.")
    if q is not None:
        tq = tk if q_segment_ids is None else q_segment_ids.shape[-1]
        hint = _layout_hint("q", q, tq)
        if hint or q.ndim != 4:
            raise ValueError(f"q must be [B,Tq,Hq,D]; got {q.shape}." + hint)
        if q_segment_ids is None and q.shape[1] != tk:
            raise ValueError(
                f"q has {q.shape[1]} tokens but k has {tk}: for cross attention pass "
                "q_segment_ids and q_positions [B,Tq]."
            )
        if q_segment_ids is not None:
            _check_ids("q_segment_ids", q_segment_ids, "[B,Tq]", q.shape[:2])
            _check_ids("q_positions", q_positions, "[B,Tq]", q.shape[:2])
    queries = [("q", q)] + ([("branch.q", branch.q)] if branch is not None else [])
    for name, x in [*queries, ("k", k), ("v", v)]:
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array; got {x.dtype}.")
    for name, x in queries:
        if x is not None and (
            x.ndim != 4 or x.shape[0] != b or x.shape[3] != d or x.shape[2] % hkv
        ):
            raise ValueError(
                f"{name} must be [B,T,Hq,D] with B={b}, D={d} and Hq a multiple of Hkv={hkv} (the "
                f"heads of k); got {x.shape}."
            )
    if branch is None:
        return
    if q is not None and branch.q.shape[2] != q.shape[2]:
        raise ValueError(
            f"branch.q has {branch.q.shape[2]} heads but q has {q.shape[2]}; both must be "
            "[B,*,Hq,D] with the same Hq."
        )
    n = branch.k.shape[1]
    if branch.k.ndim != 4 or branch.k.shape[::2] != (b, hkv) or branch.v.shape != branch.k.shape:
        raise ValueError(
            f"branch.k and branch.v must be [B,N,Hkv,D] with B={b}, Hkv={hkv}, D={d}; got "
            f"{branch.k.shape} and {branch.v.shape}."
        )
    if branch.k.shape[3] != d:
        raise ValueError(f"branch.k head dim {branch.k.shape[3]} differs from k's {d}.")
    for name in ("anchor", "parent"):
        _check_ids(f"branch.{name}", getattr(branch, name), "[B,N]", (b, n))
    nq = branch.q.shape[1]
    if branch.query_nodes is None and nq != n:
        raise ValueError(
            f"branch.q has {nq} queries for {n} nodes: pass branch.query_nodes [B,Nq]."
        )
    if branch.query_nodes is not None:
        _check_ids("branch.query_nodes", branch.query_nodes, "[B,Nq]", (b, nq))
    check_branch_values(branch, tk)
