"""The mixture-of-experts MLP of Qwen3-MoE: router, dropless grouped matmuls, expert parallelism.

Routing is `transformers`' `Qwen3MoeSparseMoeBlock`: router logits `h @ W_r`, softmax in float32,
each token's top-k experts, their probabilities renormalised to sum to 1 if `norm_topk_prob`; the
output is the probability-weighted sum of the chosen experts' SwiGLU MLPs.

Dropless: every (token, expert) assignment is computed. Assignments are sorted by expert, so the
tokens of one expert form a contiguous run, and a grouped matmul (`grouped_matmul`: Mosaic GPU
kernels on Hopper, `jax.lax.ragged_dot` elsewhere) multiplies every run by its expert's weights,
one per projection: no capacity factor, no dropped token.

Expert parallelism. Experts are split over the mesh axes ("data", "context") (`RULES["expert"]`)
and each expert's width over "tensor" (`RULES["moe_mlp"]`, as the dense MLP's). Why those axes:
tokens are distinct exactly across data and context (training splits rows over data and the
sequence over context; rollout splits rows over both), so
- a device's tokens meet their experts by one exchange among the devices that hold different
  tokens; a separate expert axis would have to split tokens too, i.e. be another data axis;
- training and rollout share one expert layout: nothing moves between a train step and a rollout;
- the expert weights, nearly all of an MoE's parameters, are split over every axis but stage.
With one device in the expert group (every axis of size 1, or no mesh) there is no exchange.

The exchange runs inside `shard_map`. Each device sorts its assignments by expert and learns every
device's per-expert counts (an all-gather of X integers). Then one ragged all-to-all with one slice
per expert sends each expert's run to the device holding that expert, where the runs land grouped
by local expert (from every source in turn), ready for the grouped matmuls; a second all-to-all
brings the results back into the sender's sorted order. The receive buffer holds P times the local
assignments (the worst case: every device routes everything to one device), which is what keeps
routing dropless with static shapes. XLA:CPU has no ragged all-to-all; there it is emulated by a
dense `all_to_all` of padded slices (the same result, more traffic): the CPU tests run that, the
GPU runs `jax.lax.ragged_all_to_all`. Tokens are replicated over "tensor": every tensor rank
routes and exchanges the same tokens for its slice of the experts' width, and a `psum` over
"tensor" sums the slices.

Load-balancing loss (`load_balancing_loss`): exactly `transformers`' `load_balancing_loss_func`.
Over all sparse layers and the valid tokens together (pooled, not averaged per layer),
`f_x` = top-k assignments to expert x / tokens and `P_x` = summed router probability of x / tokens,
and the loss is `X * sum_x f_x * P_x` (1 for perfectly uniform routing). Padding (segment id 0)
is excluded, as `transformers` excludes tokens whose attention mask is 0; `RouterStats` carries
the per-layer sums so the scanned layers only add them up.

Shape suffixes: B batch, T tokens, N = B*T flat tokens, K experts per token, A = N*K assignments,
X experts (L: local to a device), D hidden, F expert width, P devices in the expert group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jspec import mesh as mesh_lib
from jspec.config import ConfigError, ModelConfig
from jspec.models.grouped_matmul import grouped_matmul


class RouterStats(NamedTuple):
    """Sums over the valid tokens of one or more sparse layers; `load_balancing_loss` of them."""

    counts: Float[Array, " x"]  # top-k assignments to each expert
    probs: Float[Array, " x"]  # router probability given to each expert
    tokens: Float[Array, ""]  # valid tokens, counted once per layer


def route(
    logits_NX: Float[Array, "n x"], k: int, normalize: bool
) -> tuple[Float[Array, "n k"], Int[Array, "n k"], Float[Array, "n x"]]:
    """(weights of the top-k experts, their indices, all router probabilities), float32."""
    probs_NX = jax.nn.softmax(logits_NX.astype(jnp.float32), axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NX, k)
    if normalize:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return weights_NK, experts_NK, probs_NX


def router_stats(
    probs_NX: Float[Array, "n x"], experts_NK: Int[Array, "n k"], valid_N: Bool[Array, " n"]
) -> RouterStats:
    """One layer's `RouterStats`, counting only the valid tokens."""
    n, k = experts_NK.shape
    weight_N = valid_N.astype(jnp.float32)
    counts = jax.ops.segment_sum(
        jnp.repeat(weight_N, k), experts_NK.reshape(-1), num_segments=probs_NX.shape[-1]
    )
    return RouterStats(counts, weight_N @ probs_NX, jnp.sum(weight_N))


def load_balancing_loss(stats: RouterStats) -> Float[Array, ""]:
    """`transformers`' load-balancing loss of the summed stats of all sparse layers (0 without a
    valid token, where `transformers` would divide by zero)."""
    tokens = jnp.maximum(stats.tokens, 1.0)
    return stats.counts.shape[-1] * jnp.sum((stats.counts / tokens) * (stats.probs / tokens))


def swiglu_experts(
    x_AD: Float[Array, "a d"],
    group_sizes: Int[Array, " l"],
    w_gate_LDF: Float[Array, "l d f"],
    w_up_LDF: Float[Array, "l d f"],
    w_down_LFD: Float[Array, "l f d"],
) -> Float[Array, "a d"]:
    """Each run of rows through its expert's SwiGLU MLP (rows past the runs give 0)."""
    gate_AF = grouped_matmul(x_AD, w_gate_LDF, group_sizes)
    up_AF = grouped_matmul(x_AD, w_up_LDF, group_sizes)
    return grouped_matmul(jax.nn.silu(gate_AF) * up_AF, w_down_LFD, group_sizes)


# ---------------------------------------------------------------------------------------------
# The token exchange.


def _exclusive_cumsum(x: Array, axis: int) -> Array:
    return jnp.cumsum(x, axis=axis) - x


def _ragged_all_to_all_emulated(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` from a dense `all_to_all`: every slice padded to the operand's
    length (XLA:CPU has no ragged all-to-all)."""
    rows = jnp.arange(operand.shape[0])
    padded = jnp.take(operand, input_offsets[:, None] + rows, axis=0, mode="fill", fill_value=0)
    sent = (rows < send_sizes[:, None]).reshape(*padded.shape[:2], *[1] * (operand.ndim - 1))
    padded = jnp.where(sent, padded, 0)
    got = jax.lax.all_to_all(padded, axis_name, 0, 0, tiled=True)
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    slot = jnp.where(rows < recv_sizes[:, None], where[:, None] + rows, output.shape[0])
    return output.at[slot].set(got, mode="drop")


def _ragged_all_to_all(mesh: Mesh) -> Callable:
    if mesh.devices.flat[0].platform == "cpu":
        return _ragged_all_to_all_emulated
    return jax.lax.ragged_all_to_all


def _exchanged_experts(x_AD, sizes_X, w_gate, w_up, w_down, *, axes, size, ragged_all_to_all):
    """`swiglu_experts` of this device's sorted assignments, run on the `size` devices of mesh
    axes `axes` that hold their experts (L = X / size each, in order).

    Slices are per expert: this device's slice i (its run of expert i) goes to device i // L and
    lands in the run of local expert i % L, after the slices of the devices before this one.
    """
    a, local = x_AD.shape[0], w_gate.shape[0]
    me = jax.lax.axis_index(axes)
    counts_PX = jax.lax.all_gather(sizes_X, axes)  # counts_PX[s, i]: source s's run of expert i
    starts_PX = _exclusive_cumsum(counts_PX, axis=1)  # where that run starts at its source
    runs_PL = jnp.sum(counts_PX, axis=0).reshape(size, local)  # every expert's total, by device
    land_PX = _exclusive_cumsum(runs_PL, axis=1).reshape(-1) + _exclusive_cumsum(counts_PX, 0)
    mine = lambda m_PX: jax.lax.dynamic_slice_in_dim(m_PX, me * local, local, 1).reshape(-1)
    x_RD = ragged_all_to_all(
        x_AD,
        jnp.zeros((size * a, x_AD.shape[1]), x_AD.dtype),
        starts_PX[me],
        sizes_X,
        land_PX[me],
        mine(counts_PX),
        axis_name=axes,
    )
    group_sizes = jnp.sum(mine(counts_PX).reshape(size, local), axis=0)
    y_RD = swiglu_experts(x_RD, group_sizes, w_gate, w_up, w_down)
    return ragged_all_to_all(
        y_RD,
        jnp.zeros_like(x_AD, y_RD.dtype),
        mine(land_PX),
        mine(counts_PX),
        mine(starts_PX),
        sizes_X,
        axis_name=axes,
    )


def experts_forward(
    x_ND: Float[Array, "n d"],
    experts_NK: Int[Array, "n k"],
    weights_NK: Float[Array, "n k"],
    num_experts: int,
    run_sorted: Callable[[Array, Array], Array],
) -> Float[Array, "n d"]:
    """The weighted sum of each token's experts: assignments sorted by expert, run through their
    experts by `run_sorted(x_AD, sizes_X) -> y_AD` (`swiglu_experts`, here or across devices),
    and put back in token order."""
    n, k = experts_NK.shape
    flat = experts_NK.reshape(-1)
    order_A = jnp.argsort(flat, stable=True)
    sizes_X = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y_AD = run_sorted(x_ND[order_A // k], sizes_X)
    unsort_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(n * k, dtype=order_A.dtype))
    y_NKD = y_AD[unsort_A].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y_NKD, weights_NK.astype(y_NKD.dtype))


def _axes(rule) -> tuple[str, ...]:
    return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)


def sharded_experts_forward(
    mesh: Mesh, act: tuple[str | None, ...], x_BTD, experts_BTK, weights_BTK, w_gate, w_up, w_down
):
    """`experts_forward` with experts split over `RULES["expert"]` and their width over
    `RULES["moe_mlp"]`, tokens laid out by the logical activation names `act` (batch, seq)."""
    expert_axes, width_axes = _axes(mesh_lib.RULES["expert"]), _axes(mesh_lib.RULES["moe_mlp"])
    size = math.prod(mesh.shape[a] for a in expert_axes)
    rows = mesh_lib.logical_spec((*act, None))
    for dim, (extent, axes) in enumerate(zip(x_BTD.shape, rows, strict=True)):
        parts = math.prod(mesh.shape[a] for a in _axes(axes))
        if extent % parts:
            raise ConfigError(
                f"the mixture of experts splits activation axis {dim} ({act[dim]!r}, {extent} "
                f"long) over mesh axes {axes} ({parts} devices), which does not divide it; pad "
                f"the batch (or sequence) to a multiple of {parts}."
            )
    ragged_all_to_all = _ragged_all_to_all(mesh)

    def local(x_BTD, experts_BTK, weights_BTK, w_gate, w_up, w_down):
        b, t, d = x_BTD.shape
        flat = lambda a: a.reshape(b * t, -1)

        def run(x_AD, sizes_X):
            if size == 1:
                return swiglu_experts(x_AD, sizes_X, w_gate, w_up, w_down)
            return _exchanged_experts(
                x_AD,
                sizes_X,
                w_gate,
                w_up,
                w_down,
                axes=expert_axes,
                size=size,
                ragged_all_to_all=ragged_all_to_all,
            )

        y_ND = experts_forward(
            flat(x_BTD), flat(experts_BTK), flat(weights_BTK), w_gate.shape[0] * size, run
        )
        if width_axes:
            y_ND = jax.lax.psum(y_ND, width_axes)
        return y_ND.reshape(b, t, d)

    in_weights = mesh_lib.logical_spec(("expert", "embed", "moe_mlp"))
    out_weights = mesh_lib.logical_spec(("expert", "moe_mlp", "embed"))
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, in_weights, in_weights, out_weights),
        out_specs=rows,
        check_vma=True,
    )(x_BTD, experts_BTK, weights_BTK, w_gate, w_up, w_down)


# ---------------------------------------------------------------------------------------------
# The module.


class MoE(nnx.Module):
    """The sparse MLP of `num_layers` layers, stacked on axis 0 (as `transformer.Block`): router
    `[D,X]`, experts `w_gate, w_up [X,D,F]`, `w_down [X,F,D]` per layer.

    `param(shape, axes, fan_in=...)` makes a parameter with the decoder's initialiser. `mesh`
    (static) selects expert parallelism; None runs every expert here.
    """

    def __init__(self, config: ModelConfig, num_layers: int, param: Callable, mesh: Mesh | None):
        c, n = config, num_layers
        d, x, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.config, self.mesh = config, mesh
        self.router = param((n, d, x), ("layers", "embed", None), fan_in=d)
        self.w_gate = param((n, x, d, f), ("layers", "expert", "embed", "moe_mlp"), fan_in=d)
        self.w_up = param((n, x, d, f), ("layers", "expert", "embed", "moe_mlp"), fan_in=d)
        self.w_down = param((n, x, f, d), ("layers", "expert", "moe_mlp", "embed"), fan_in=f)

    def __call__(
        self, h_BTD: Float[Array, "b t d"], valid_BT: Bool[Array, "b t"] | None, act
    ) -> tuple[Float[Array, "b t d"], RouterStats]:
        """One layer (a one-layer slice of the weights) on tokens laid out as the logical names
        `act`; the router stats count the tokens where `valid_BT` (None: all)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        w = lambda p: p[...].astype(dt)
        b, t, d = h_BTD.shape
        logits_BTX = jnp.einsum("btd,dx->btx", h_BTD, w(self.router))
        weights_BTK, experts_BTK, probs_BTX = route(
            logits_BTX, c.num_experts_per_tok, c.norm_topk_prob
        )
        valid_N = jnp.ones((b * t,), bool) if valid_BT is None else valid_BT.reshape(-1)
        stats = router_stats(probs_BTX.reshape(b * t, -1), experts_BTK.reshape(b * t, -1), valid_N)
        weights_BTK = weights_BTK.astype(dt)
        experts = (w(self.w_gate), w(self.w_up), w(self.w_down))
        if self.mesh is None:
            flat = lambda a: a.reshape(b * t, -1)
            run = lambda x_AD, sizes_X: swiglu_experts(x_AD, sizes_X, *experts)
            y_BTD = experts_forward(
                flat(h_BTD), flat(experts_BTK), flat(weights_BTK), c.num_experts, run
            ).reshape(b, t, d)
        else:
            y_BTD = sharded_experts_forward(
                self.mesh, act, h_BTD, experts_BTK, weights_BTK, *experts
            )
        return y_BTD, stats
