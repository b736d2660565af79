"""The EAGLE-3 draft's co-training loss: the training-time test over the policy's own features.

Pass 0 (the trunk) runs the draft layer causally over the rollout: position t pairs the policy's
taps at t with the embedding of token t + 1 and is scored against the policy's distribution at
t + 1. Each of the `steps` branch passes i = 1..S then feeds the previous pass's output hidden state
back in at the same position, with inputs and targets shifted by one more token (embedding of token
t + 1 + i, teacher at t + 1 + i), as the draft runs at inference. Pass i's node at t sits at RoPE
position pos[t] + i, sees the trunk keys up to t and its own earlier nodes (t, 1..i-1): a
`jspec.attention.Branch` anchored at t with parent (t, i - 1), whose K/V of every pass are kept and
whose queries are pass i's only (`query_nodes`), the trunk query None. Memory is linear in T * S.

The teacher is the detached policy distribution at the sampling temperature, restricted to the
draft vocabulary and renormalised there; the loss of pass i is the soft cross-entropy over the
response tokens, weighted decay**i. The teacher's logits come from the policy's final-normed hidden
states and the rows of its head the draft vocabulary holds (never the policy's logits over the
whole vocabulary); teacher's and draft's are made chunk by chunk along the sequence
(rematerialised in the backward pass), never for the whole batch at once.

A block draft (`jspec.models.block`, DFlash style) is trained by the same loss on other passes
(`block_passes`): its block after every trunk token t (the root token t + 1, masks after it) is one
forward, and block position k = i + 1 predicts token t + 1 + k, so it is scored as pass i is (the
teacher at t + 1 + i, weight decay**i): DFlash's exp(-(k - 1) / gamma) with decay = exp(-1 / gamma).

Context parallelism: shifts are made in natural order, then the draft runs in the ring's zigzag
layout (`zigzag_shard`), every pass's branch nodes on the rank of their anchor, and the hidden
states come back to natural order for the loss. So a shifted input that crosses a zigzag chunk
edge is read from the right token wherever it lives, and the result equals context=1's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jspec import mesh as mesh_lib
from jspec.attention import Branch, attention, zigzag_shard, zigzag_unshard
from jspec.attention.parallel import sharded_ring
from jspec.models import output_head
from jspec.models.block import BlockDraft
from jspec.models.draft import OneLayerDraft, Shared
from jspec.models.layers import rope_angles


class DraftLossOut(NamedTuple):
    loss: Float[Array, ""]  # sum over passes of decay**i * mean soft cross-entropy of pass i
    per_pass: Float[Array, " s"]  # mean soft cross-entropy of each pass
    agreement: Float[Array, ""]  # top-1 agreement of pass 0 with the teacher, over its tokens


def shift(x: Array, k: int, fill) -> Array:
    """x[:, t + k] at t (natural order), `fill` past the end."""
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


class _Layout:
    """Where the draft's passes run: natural order on one context rank, else the zigzag ring."""

    def __init__(self, segment_ids, mesh: Mesh | None):
        axis = mesh_lib.RULES["seq"]
        self.cp = 1 if mesh is None or axis is None else mesh.shape[axis]
        self.mesh, self.natural_seg = mesh, segment_ids
        self.ring = None
        if mesh is not None and mesh.size > 1:  # under shard_map, as the model's forward
            self.ring = sharded_ring(
                mesh,
                axis,
                batch_axis=mesh_lib.RULES["batch"],
                head_axis=mesh_lib.RULES["act_heads"],
            )
        self.seg = self.shard(segment_ids)

    def shard(self, x):
        """x [B,T,...] in the zigzag layout."""
        return x if self.cp == 1 else self.split(zigzag_shard(x, self.natural_seg, self.cp))

    def unshard(self, x):
        """x [B,T,...] back in natural order."""
        return x if self.cp == 1 else self.split(zigzag_unshard(x, self.natural_seg, self.cp))

    def split(self, x):
        """x with its tokens split over the context ranks, in either order: the permutations
        gather what they move, and left so, every rank would run the draft on the whole row."""
        return mesh_lib.constrain(x, self.mesh, ("batch", "seq", *(None,) * (x.ndim - 2)))

    def attend(self, q, k, v, positions, branch=None):
        """(trunk out, branch out) of the layout's attention (one of them may be None)."""
        if self.ring is not None:
            return self.ring(q, k, v, self.seg, positions, branch)
        out = attention(q, k, v, self.seg, positions, branch=branch)
        return out if branch is not None else (out, None)

    def stack(self, xs: list) -> Array:
        """n arrays [B,T,...] of this layout as one [B, n * T, ...] in rank-major slots: rank
        r's tokens of every array together, array by array (as the ring wants branch nodes)."""
        b, t = xs[0].shape[:2]
        local = t // self.cp
        split = [x.reshape(b, self.cp, local, *x.shape[2:]) for x in xs]
        return jnp.stack(split, axis=2).reshape(b, len(xs) * t, *xs[0].shape[2:])

    def unstack(self, x, n: int) -> list:
        """The n arrays [B,T,...] that `stack` joined into x."""
        b, t = x.shape[0], x.shape[1] // n
        x = x.reshape(b, self.cp, n, t // self.cp, *x.shape[2:])
        return [x[:, :, i].reshape(b, t, *x.shape[4:]) for i in range(n)]

    def pass_branch(self, q, k, v) -> Branch:
        """The branch of a chain of n nodes per trunk token t (K/V `stack`ed, [B, n * T, K, E]):
        node (t, j) anchored at t with parent (t, j - 1); every query (`stack`ed, any number per
        token) belongs to its token's last node, so it sees the whole chain.

        Indices are local to each rank's T / cp tokens (rank-major slots, as the ring wants)."""
        b, t = self.seg.shape
        local = t // self.cp
        n, nq = k.shape[1] // t, q.shape[1] // t
        slot = jnp.arange(local, dtype=jnp.int32)
        j = jnp.arange(n, dtype=jnp.int32)[:, None]
        per_rank = lambda x, m: jnp.broadcast_to(x, (b, self.cp, m, local)).reshape(b, -1)
        return Branch(
            q,
            k,
            v,
            anchor=per_rank(slot, n),
            parent=per_rank(jnp.where(j == 0, -1, (j - 1) * local + slot), n),
            query_nodes=per_rank((n - 1) * local + slot, nq),
        )


def draft_passes(
    draft: OneLayerDraft,
    shared: Shared,
    taps: Float[Array, "taps b t d"],
    tokens: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    steps: int,
    mesh: Mesh | None = None,
) -> list[Float[Array, "b t d"]]:
    """Output hidden states of the trunk pass and `steps` branch passes, natural order."""
    layout = _Layout(segment_ids, mesh)
    pos = layout.shard(positions)
    cfg = draft.config.layer
    emb = lambda i: layout.shard(
        jnp.take(shared.embed, shift(tokens, 1 + i, 0), axis=0, mode="clip")
    )

    def trunk(q, k, v):
        return layout.attend(q, k, v, pos)[0]

    hidden, (k0, v0) = draft.layer(
        emb(0), layout.shard(draft.fuse(taps)), rope_angles(cfg, pos), trunk
    )
    outs, ks, vs = [hidden], [], []
    for i in range(1, steps + 1):

        def branch(q, k, v):
            chain = layout.pass_branch(q, layout.stack([*ks, k]), layout.stack([*vs, v]))
            return layout.attend(None, k0, v0, pos, chain)[1]

        hidden, (k, v) = draft.layer(emb(i), hidden, rope_angles(cfg, pos + i), branch)
        outs.append(hidden)
        ks.append(k)
        vs.append(v)
    return [layout.unshard(h) for h in outs]


def block_passes(
    draft: BlockDraft,
    shared: Shared,
    taps: Float[Array, "taps b t d"],
    tokens: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    mesh: Mesh | None = None,
) -> list[Float[Array, "b t d"]]:
    """A block draft's output hidden states at its predicted positions k = 1 .. block_size - 1,
    natural order, of the block after every trunk token t: the root token t + 1 at position
    pos[t] + 1, masks after it, seeing the context up to t and the whole block (a chain of
    nodes anchored at t whose last node every query of the block belongs to), through the
    chained head where the draft has one."""
    layout = _Layout(segment_ids, mesh)
    n, cfg = draft.config.block_size, draft.config.layer
    pos = layout.shard(positions)
    ctx, ctx_cos_sin = layout.shard(draft.fuse(taps)), rope_angles(cfg, pos)
    roots = layout.shard(shift(tokens, 1, 0))
    x = layout.split(layout.stack(list(draft.block_inputs(shared, roots))))
    cos_sin = rope_angles(cfg, layout.stack([pos + 1 + k for k in range(n)]))

    def attend(i, layer, q, k, v):
        k0, v0 = draft.context_kv(layer, ctx, ctx_cos_sin)
        return layout.attend(None, k0, v0, pos, layout.pass_branch(q, k, v))[1]

    out = layout.unstack(layout.split(draft.forward(x, cos_sin, attend)), n)
    h = [layout.unshard(h) for h in out]
    z, zs = h[0], []
    for k in range(1, n):  # the chained head fed the data's token k - 1 of the block
        z = draft.chain(shared, h[k], z, shift(tokens, k, 0))
        zs.append(z)
    return zs


def pass_targets(
    response: Bool[Array, "b t"], segment_ids: Int[Array, "b t"], i: int
) -> Bool[Array, "b t"]:
    """Positions t scored in pass i: token t + 2 + i is a response token of t's document."""
    same_doc = shift(segment_ids, 2 + i, 0) == segment_ids
    return shift(response, 2 + i, False) & same_doc & (segment_ids != 0)


def _soft_cross_entropy(draft, shared, hidden, teacher, mask, offset, temperature, chunk):
    """Sums over `mask` of the soft cross-entropy and of top-1 agreement, chunk by chunk: draft
    logits of hidden[t] against the teacher at t + offset (`teacher`: the policy's hidden states
    and the rows of its head the draft vocabulary holds)."""
    teacher_hidden, head_VD = teacher
    b, t, _ = hidden.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, pad)))

    @jax.checkpoint
    def one(c):
        start = c * chunk
        rows = jnp.minimum(start + offset + jnp.arange(chunk), t - 1)
        z = output_head.logits(jnp.take(teacher_hidden, rows, axis=1), head_VD, temperature)
        h = jax.lax.dynamic_slice_in_dim(hidden, start, chunk, axis=1)
        logits = draft.draft_logits(h, shared)
        m = jax.lax.dynamic_slice_in_dim(mask, start, chunk, axis=1)
        p = jax.nn.softmax(z, axis=-1)
        ce = -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        agree = jnp.argmax(logits, axis=-1) == jnp.argmax(z, axis=-1)
        return jnp.sum(jnp.where(m, ce, 0.0)), jnp.sum(m & agree)

    ce, agree = jax.lax.map(one, jnp.arange(n))
    return ce.sum(), agree.sum()


def draft_loss(
    draft: OneLayerDraft | BlockDraft,
    shared: Shared,
    taps: Float[Array, "taps b t d"],
    teacher_hidden: Float[Array, "b t d"],
    tokens: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    response: Bool[Array, "b t"],
    *,
    steps: int,
    decay: float,
    temperature: float,
    chunk: int,
    mesh: Mesh | None = None,
) -> DraftLossOut:
    """The training-time-test loss (module docstring), or a block draft's block loss (every
    block position scored; with `steps=0`, a frozen draft's metric, the first alone). Inputs are
    detached here: the draft never back-propagates into the policy."""
    shared, taps, teacher_hidden = jax.lax.stop_gradient((shared, taps, teacher_hidden))
    if isinstance(draft, BlockDraft):  # every block position; with steps=0 the first alone
        hiddens = block_passes(draft, shared, taps, tokens, segment_ids, positions, mesh)
        hiddens = hiddens if steps else hiddens[:1]
    else:
        hiddens = draft_passes(draft, shared, taps, tokens, segment_ids, positions, steps, mesh)
    head_VD = draft.from_target_vocab(shared.head.T).T.astype(teacher_hidden.dtype)
    teacher = (teacher_hidden, head_VD)  # the policy's distribution over the draft vocabulary
    losses, agreement = [], None
    for i, hidden in enumerate(hiddens):
        mask = pass_targets(response, segment_ids, i)
        count = jnp.maximum(mask.sum(), 1)
        ce, agree = _soft_cross_entropy(
            draft, shared, hidden, teacher, mask, 1 + i, temperature, chunk
        )
        losses.append(ce / count)
        agreement = agree / count if i == 0 else agreement
    per_pass = jnp.stack(losses)
    weights = decay ** jnp.arange(len(losses), dtype=jnp.float32)
    return DraftLossOut(jnp.sum(weights * per_pass), per_pass, agreement)
