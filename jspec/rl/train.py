"""The train step: one jitted program that updates the policy and the draft together.

    policy forward on the packed rollouts (training forward, with the draft's features)
      -> per-token log-probabilities at the sampling temperature -> GRPO loss (or SFT)
      -> draft loss on the same forward's detached taps and logits (`draft_loss`: the trunk
         pass and the training-time test's branch passes), on `rl.draft_rows` of the rows
      -> one optax update of both parameter groups

The policy runs once: the draft reads its taps and logits, never calls it again (a test counts the
dot operations), and never back-propagates into it. With the draft frozen, only its trunk pass
runs (forward only), for the agreement metric; without a draft, nothing of it is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jspec import mesh as mesh_lib
from jspec.config import RLConfig, RolloutConfig
from jspec.models.draft import Shared
from jspec.rl import grpo
from jspec.rl.draft_loss import draft_loss
from jspec.rl.packing import PackedBatch
from jspec.rl.state import Networks, TrainState, placement


def make_loss(
    networks: Networks,
    rl: RLConfig,
    rollout: RolloutConfig,
    *,
    objective: str = "grpo",
    num_sequences: int,
):
    """`loss(trainable, fixed, reference, batch) -> (loss, metrics)`: the policy loss ('grpo' or
    'sft') plus, when the draft is among the `trainable` params, the weighted draft loss; `fixed`
    params are not differentiated (a frozen draft is only measured). `num_sequences` is the
    batch's sequence count (for sequence-level normalisation)."""
    temperature = rollout.temperature

    def losses(trainable, fixed, reference, batch: PackedBatch):
        params = {**trainable, **jax.tree.map(jax.lax.stop_gradient, fixed)}
        policy, draft = networks.models(params)
        features = None if draft is None else draft.features
        out = policy(batch.tokens, batch.segment_ids, batch.positions, features=features)
        logits, taps = out if draft is not None else (out, None)
        logp = grpo.token_logprobs(logits, batch.tokens, temperature)
        if objective == "sft":
            loss, metrics = grpo.sft_loss(logp, batch.response)
        else:
            loss, metrics = grpo.policy_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.response,
                batch.sequence,
                num_sequences=num_sequences,
                clip_epsilon=rl.clip_epsilon,
                normalization=rl.normalization,
                kl_coef=rl.kl_coef,
                ref_logprobs=_reference_logprobs(networks, reference, batch, temperature),
            )
        metrics["policy_loss"] = loss
        if draft is None:
            return loss, metrics
        rows = rl.draft_rows if objective == "grpo" else 0
        d = draft_loss(
            draft,
            Shared.of(policy),
            *_draft_rows(
                rows,
                networks.mesh,
                taps,
                logits,
                batch.tokens,
                batch.segment_ids,
                batch.positions,
                batch.response,
            ),
            steps=rl.ttt_steps if "draft" in trainable else 0,  # frozen: pass 0's agreement
            decay=rl.ttt_decay,
            temperature=temperature,
            chunk=rl.loss_chunk,
            mesh=networks.mesh,
        )
        metrics.update(draft_loss=d.loss, agreement=d.agreement)
        if "draft" in trainable:
            loss = loss + rl.draft_loss_weight * d.loss
        return loss, metrics

    return losses


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, grads) -> TrainState:
    """One update by `tx` of the parameter groups `grads` holds (the trained ones), the step
    counted."""
    trainable = {k: state.params[k] for k in grads}
    updates, opt_state = tx.update(grads, state.opt_state, trainable)
    params = {**state.params, **optax.apply_updates(trainable, updates)}
    return state._replace(params=params, opt_state=opt_state, step=state.step + 1)


def make_train_step(
    networks: Networks,
    tx: optax.GradientTransformation,
    trained: tuple[str, ...],
    rl: RLConfig,
    rollout: RolloutConfig,
    *,
    objective: str = "grpo",
    num_sequences: int,
):
    """A jitted `step(state, batch) -> (state, metrics)`: `make_loss`'s gradients, one update of
    the groups `trained` by `tx` ('policy', and 'draft' when co-trained). `step.lower(state,
    batch)` lowers it ahead of time (abstract arrays are enough: `jspec.jobs.plan`)."""
    losses = make_loss(networks, rl, rollout, objective=objective, num_sequences=num_sequences)

    def step(state: TrainState, batch: PackedBatch):
        trainable = {k: state.params[k] for k in trained}
        fixed = {k: v for k, v in state.params.items() if k not in trained}
        grads, metrics = jax.grad(losses, has_aux=True)(trainable, fixed, state.reference, batch)
        for name, g in grads.items():
            metrics[f"{name}_grad_norm"] = optax.tree.norm(g)
        return apply_gradients(tx, state, grads), metrics

    compiled = {}

    def jitted(state: TrainState):
        keep = None if networks.mesh is None else placement(state, networks.mesh)
        return jax.jit(step, out_shardings=(keep, None), donate_argnums=0)

    def run(state: TrainState, batch: PackedBatch):
        """The jitted step; the state leaves it placed as it came (one compilation per run)."""
        if "step" not in compiled:
            compiled["step"] = jitted(state)
        return compiled["step"](state, batch)

    # Ahead of time, from abstract arrays with shardings (jspec.jobs.plan): run.lower(state, batch).
    run.lower = lambda state, batch: jitted(state).lower(state, batch)
    return run


def _draft_rows(rows: int, mesh, taps, *arrays):
    """(taps [L,B',T,D], *arrays [B',...]): `rows` rows of the batch (0: all), rounded up to a
    multiple of the data shards, spread evenly over each shard's, so none moves between devices."""
    if not rows:
        return (taps, *arrays)
    shards = 1 if mesh is None else mesh_lib.axis_size(mesh, "batch")
    local, per_shard = taps.shape[1] // shards, -(-rows // shards)
    spread = jnp.arange(per_shard) * local // per_shard
    pick = lambda x: mesh_lib.take_local_rows(x, jnp.broadcast_to(spread, (shards, per_shard)))
    return (jax.vmap(pick)(taps), *map(pick, arrays))


def _reference_logprobs(networks: Networks, reference, batch: PackedBatch, temperature):
    """The frozen reference policy's log-probabilities (None without a reference)."""
    if reference is None:
        return None
    ref = networks.policy.merge(jax.lax.stop_gradient(reference))
    logits = ref(batch.tokens, batch.segment_ids, batch.positions)
    return grpo.token_logprobs(logits, batch.tokens, temperature)
