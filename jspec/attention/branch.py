"""The branch: extra nodes (a draft tree, or training-time-test steps) hanging off trunk tokens."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class Branch(NamedTuple):
    """Branch nodes and their queries (a pytree).

    k, v: [B,N,Hkv,D] keys and values of the nodes. anchor [B,N]: the trunk token each node hangs
    off (-1: padding node). parent [B,N]: the parent node (-1: none). q [B,Nq,Hq,D]: branch queries;
    query_nodes [B,Nq]: the node each query belongs to (None: Nq = N and query i is node i).
    """

    q: Float[Array, "b nq hq d"]
    k: Float[Array, "b n hkv d"]
    v: Float[Array, "b n hkv d"]
    anchor: Int[Array, "b n"]
    parent: Int[Array, "b n"]
    query_nodes: Int[Array, "b nq"] | None = None

    def nodes(self) -> Int[Array, "b nq"]:
        """The node of each query."""
        if self.query_nodes is not None:
            return self.query_nodes
        b, n = self.anchor.shape
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
