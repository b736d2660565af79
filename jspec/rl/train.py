"""The train step: one jitted program that updates the policy and the draft together.

    policy forward on the packed rollouts (training forward, with the draft's features)
      -> per-token log-probabilities at the sampling temperature -> GRPO loss (or SFT)
      -> draft loss on the same forward's detached taps and logits (`draft_loss`: the trunk
         pass and the training-time test's branch passes), on `rl.draft_rows` of the rows
      -> one optax update of both parameter groups

The policy runs once: the draft reads its taps and logits, never calls it again (a test counts the
dot operations), and never back-propagates into it. With the draft frozen, only its trunk pass
runs (forward only), for the agreement metric; without a draft, nothing of it is traced.

Repeated runs in one process (tests, notebooks, the experiment driver) reuse the compiled step:
`make_train_step` keeps the jitted steps of the process (the last 16 used; `clear_cache`
empties it) by everything the traced program depends on: the networks' graph definitions and
parameter structures, the mesh, the state's shardings, the optimizer (`jspec.rl.state.adamw`
gives equal hyperparameters one object), the trained groups, the objective, the sequence count,
and every field of the RL and rollout configs but those of `UNREAD`. The networks' non-parameter
state (the draft's vocabulary map) is an argument of the program, not a constant in it.
"""

from __future__ import annotations

import dataclasses
import functools

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

# Config fields the train step never reads: how long a run lasts and where it saves, the task and
# the tokenizer, how rollouts are scheduled and decoded. Runs that differ only in these share a
# compiled step; every other field is in its cache key, read by the step or not (a field wrongly
# here would give a run another's program; one wrongly absent only compiles the step again).
UNREAD = {
    RLConfig: (
        "task",
        "policy",
        "tokenizer",
        "eos_token",
        "steps",
        "sft_steps",
        "save_every",
        "samples_every",
        "keep_checkpoints",
        "max_lag",
        "tree_costs",
    ),
    RolloutConfig: ("max_new_tokens", "eos_id", "tree", "rows", "refill_rows", "buckets"),
}


@functools.lru_cache(maxsize=16)
def _step_slot(key) -> dict:
    return {}  # the jitted step of `key`, shared by the runs of a process that trace its program


def clear_cache() -> None:
    """Forgets every compiled train step of the process (see the module's docstring)."""
    _step_slot.cache_clear()


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

    def logprobs(policy, hidden, tokens):
        head, chunks = policy.head[...], rl.vocab_chunks
        return grpo.token_logprobs(hidden, head, tokens, temperature, chunks, networks.mesh)

    def losses(trainable, fixed, reference, batch: PackedBatch):
        params = {**trainable, **jax.tree.map(jax.lax.stop_gradient, fixed)}
        policy, draft = networks.models(params)
        features = None if draft is None else draft.features
        out = policy(
            batch.tokens, batch.segment_ids, batch.positions, features=features, head=False
        )
        hidden, taps = out if draft is not None else (out, None)
        logp = logprobs(policy, hidden, batch.tokens)
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
                ref_logprobs=_reference_logprobs(networks, reference, batch, logprobs),
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
                hidden,
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
    the groups `trained` by `tx` ('policy', and 'draft' when co-trained), the state left placed as
    it came. The program is compiled once for the first state's placement, and shared with the
    steps of earlier runs of the process that trace the same program (the module's docstring).
    `step.lower(state, batch)` lowers it ahead of time (abstract arrays are enough:
    `jspec.jobs.plan`)."""
    key = (_networks_key(networks), tx, tuple(trained), objective, num_sequences)
    key += (_read_fields(rl), _read_fields(rollout))

    def step(state: TrainState, batch: PackedBatch, rests):
        nets = networks.with_rests(rests)
        losses = make_loss(nets, rl, rollout, objective=objective, num_sequences=num_sequences)
        trainable = {k: state.params[k] for k in trained}
        fixed = {k: v for k, v in state.params.items() if k not in trained}
        grads, metrics = jax.grad(losses, has_aux=True)(trainable, fixed, state.reference, batch)
        for name, g in grads.items():
            metrics[f"{name}_grad_norm"] = optax.tree.norm(g)
        return apply_gradients(tx, state, grads), metrics

    def keep(state: TrainState):
        return None if networks.mesh is None else placement(state, networks.mesh)

    compiled, rests = {}, networks.rests()

    def run(state: TrainState, batch: PackedBatch):
        """The jitted step (looked up once a run)."""
        if "step" not in compiled:
            shardings = keep(state)
            slot = _step_slot((*key, *_flat(shardings)))
            if "step" not in slot:
                slot["step"] = jax.jit(step, out_shardings=(shardings, None), donate_argnums=0)
            compiled["step"] = slot["step"]
        return compiled["step"](state, batch, rests)

    # Ahead of time, the constants closed over: a program of (state, batch), as `run` is.
    run.lower = lambda state, batch: jax.jit(
        lambda state, batch: step(state, batch, rests),
        out_shardings=(keep(state), None),
        donate_argnums=0,
    ).lower(state, batch)
    return run


def _networks_key(networks: Networks):
    """What the step's program depends on of `networks`: not the values of their non-parameter
    state (an argument of the program), only its structure."""
    net = lambda n: None if n is None else (n.graphdef, n.treedef, jax.tree.structure(n.rest))
    return net(networks.policy), net(networks.draft), networks.mesh


def _read_fields(config):
    """(type, (name, value) of each field of `config` not in UNREAD): hashable."""
    unread = UNREAD[type(config)]
    fields = dataclasses.fields(config)
    return type(config), tuple(
        (f.name, getattr(config, f.name)) for f in fields if f.name not in unread
    )


def _flat(tree) -> tuple:
    """A tree of shardings (or None) as a hashable (treedef, leaves...)."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *leaves)


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


def _reference_logprobs(networks: Networks, reference, batch: PackedBatch, logprobs):
    """The frozen reference policy's log-probabilities (None without a reference)."""
    if reference is None:
        return None
    ref = networks.policy.merge(jax.lax.stop_gradient(reference))
    return logprobs(
        ref, ref(batch.tokens, batch.segment_ids, batch.positions, head=False), batch.tokens
    )
