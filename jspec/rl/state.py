"""TrainState: everything a run changes, as one pytree; the optimizer of both training jobs.

The policy and draft parameters are plain nested dicts (`nnx.to_pure_dict`), so optax, orbax and
`jit` see ordinary pytrees; `Networks` holds the static rest (graph definitions, the draft's
vocabulary map) and turns parameters back into modules inside `jit` (the train step takes the
vocabulary map as an argument, `Networks.rests`, so that runs of other maps share its program).
The sampler reads the same TrainState the train step writes: there is no weight sync.

Optimizers (`adamw`, both training jobs'): one `optax.multi_transform` with a group per parameter
set (`Group`), each with its own learning rate, gradient clipping, weight decay and optional
warmup-cosine schedule over its steps (the draft's gradients are clipped apart from the policy's).
Equal groups give the same optax object, so that repeated runs in one process (tests, notebooks,
the experiment driver) reuse the programs compiled for it: `jit(tx.init)` and the train step
(`jspec.rl.train.make_train_step`, whose cache key holds the optimizer).
`optimizer` gives an RL run's groups (the `rl` config); `jspec.jobs.train_code_lm` makes one group
per stage. A frozen draft is not in the optimizer at all.

Randomness: `rng` is one key; each step's rollout key is `fold_in(rng, step)`, so a resumed run
draws what the uninterrupted run drew. Under SPMD `jit` a global key gives every data-parallel rank
different bits for its own rows and every tensor or context replica the same bits for the same
rows, which is what seeding per data-parallel rank is for (replicas never diverge).

Checkpoints of a TrainState: `jspec.rl.checkpoints.Checkpoints`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.config import ConfigError, RLConfig
from jspec.models.transformer import param_shardings

DRAFT_MODES = ("cotrain", "frozen", "none")


class TrainState(NamedTuple):
    params: dict[str, Any]  # {"policy": ..., "draft": ...}; no "draft" without one
    opt_state: Any  # of the trained groups only
    reference: Any  # frozen policy params for the KL penalty, or None
    step: jax.Array  # int32: RL steps done
    rng: jax.Array  # uint32 key data


class _Net(NamedTuple):
    graphdef: Any
    treedef: Any  # of the nnx.State of its parameters
    rest: Any  # non-parameter state (the draft's vocabulary map), constant over a run

    def merge(self, params):
        state = jax.tree.unflatten(self.treedef, jax.tree.leaves(params))
        return nnx.merge(self.graphdef, state, self.rest)


@dataclasses.dataclass(frozen=True, eq=False)
class Networks:
    """The static parts of the policy and the draft (None: no draft)."""

    policy: _Net
    draft: _Net | None
    mesh: Mesh | None

    @classmethod
    def split(cls, policy, draft, mesh: Mesh | None) -> tuple[Networks, dict]:
        """(Networks, params) of live modules."""
        nets, params = {}, {}
        for name, module in (("policy", policy), ("draft", draft)):
            if module is None:
                continue
            graphdef, state, rest = nnx.split(module, nnx.Param, ...)
            nets[name] = _Net(graphdef, jax.tree.structure(state), rest)
            params[name] = nnx.to_pure_dict(state)
        return cls(nets["policy"], nets.get("draft"), mesh), params

    def models(self, params: dict):
        """(policy, draft or None) as modules, from params."""
        draft = None if self.draft is None else self.draft.merge(params["draft"])
        return self.policy.merge(params["policy"]), draft

    def rests(self) -> dict:
        """The non-parameter state of each network, for a jitted program to take as an argument
        (`with_rests` inside it) rather than close over as a constant of its own."""
        return {
            "policy": self.policy.rest,
            "draft": None if self.draft is None else self.draft.rest,
        }

    def with_rests(self, rests: dict) -> Networks:
        """These networks with `rests` (of `rests()`'s structure) as their non-parameter state."""
        net = lambda n, rest: None if n is None else n._replace(rest=rest)
        policy, draft = net(self.policy, rests["policy"]), net(self.draft, rests["draft"])
        return dataclasses.replace(self, policy=policy, draft=draft)

    def shardings(self, params: dict) -> dict:
        """NamedShardings of params by their logical axes (`jspec.mesh.RULES`)."""
        out = {}
        for name, net in (("policy", self.policy), ("draft", self.draft)):
            if name in params:
                state = jax.tree.unflatten(net.treedef, jax.tree.leaves(params[name]))
                out[name] = nnx.to_pure_dict(param_shardings(state, self.mesh))
        return out


class Group(NamedTuple):
    """One parameter group of `adamw`: its (peak) learning rate, the global norm its gradients are
    clipped to, its weight decay, and the steps of its warmup-cosine schedule (None: a constant
    learning rate after `warmup_steps` of a linear warmup from 0; else a linear warmup from 0 over
    the first 1/20 of the steps, at least one, then a cosine decay to 0 at the last)."""

    learning_rate: float
    max_grad_norm: float
    weight_decay: float = 1e-4  # optax.adamw's default
    schedule_steps: int | None = None
    warmup_steps: int = 0

    def rate(self):
        """The learning rate: a float, or the schedule over the steps."""
        if self.schedule_steps is None and self.warmup_steps:
            return optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        if self.schedule_steps is None:
            return self.learning_rate
        warmup = max(self.schedule_steps // 20, 1)
        end = max(self.schedule_steps, warmup + 1)
        return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, warmup, end)


def adamw(groups: dict[str, Group]):
    """The optimizer of parameters `{group name: params}`: one multi_transform over the groups,
    each AdamW after clipping its own gradients by their global norm. Equal groups (in the same
    order) give the same object: see the module's docstring."""
    return _adamw(tuple(groups.items()))


@functools.lru_cache(maxsize=32)
def _adamw(groups: tuple[tuple[str, Group], ...]):
    transforms = {
        name: optax.chain(
            optax.clip_by_global_norm(g.max_grad_norm),
            optax.adamw(g.rate(), weight_decay=g.weight_decay),
        )
        for name, g in groups
    }
    labels = lambda params: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}
    return optax.multi_transform(transforms, labels)


def optimizer(rl: RLConfig, trained: tuple[str, ...], policy_learning_rate: float):
    """`adamw` of an RL run's trained groups: the policy's at `policy_learning_rate` (the warm
    start's or RL's) clipped to rl.max_grad_norm, the draft's at rl.draft_learning_rate clipped to
    rl.draft_max_grad_norm, each reached after rl.warmup_steps."""
    groups = {
        "policy": Group(policy_learning_rate, rl.max_grad_norm, warmup_steps=rl.warmup_steps),
        "draft": Group(
            rl.draft_learning_rate, rl.draft_max_grad_norm, warmup_steps=rl.warmup_steps
        ),
    }
    return adamw({name: groups[name] for name in trained})


def trained_groups(mode: str, has_draft: bool) -> tuple[str, ...]:
    """Parameter groups the optimizer updates under draft mode `mode`."""
    if mode not in DRAFT_MODES:
        raise ConfigError(f"draft mode {mode!r} is not one of {', '.join(map(repr, DRAFT_MODES))}.")
    return ("policy", "draft") if mode == "cotrain" and has_draft else ("policy",)


def init_state(
    networks: Networks, params: dict, tx, trained, *, seed: int, reference: bool
) -> TrainState:
    """A fresh TrainState (step 0) around `params`: parameters placed by the logical-axis rules,
    optimizer moments like their parameters, everything else replicated over the mesh (so every
    train step and rollout sees one placement and compiles once)."""
    trainable = {k: params[k] for k in trained}
    if networks.mesh is None:
        opt_state = jax.jit(tx.init)(trainable)
    else:
        params = jax.device_put(params, networks.shardings(params))
        trainable = {k: params[k] for k in trained}
        shardings = moment_shardings(jax.eval_shape(tx.init, trainable), trainable, networks.mesh)
        opt_state = jax.jit(tx.init, out_shardings=shardings)(trainable)
    ref = jax.tree.map(jnp.copy, params["policy"]) if reference else None
    rng = jax.random.key_data(jax.random.key(seed))
    state = TrainState(params, opt_state, ref, jnp.int32(0), rng)
    if networks.mesh is None:
        return state
    return jax.device_put(state, placement(state, networks.mesh))


def moment_shardings(opt_state, params, mesh: Mesh):
    """Shardings of an optimizer state: a leaf reached by a parameter's path (its suffix) with the
    parameter's shape, such as Adam's moments, is placed as that parameter; the rest replicated.

    A plain `jit(tx.init)` leaves the moments' zeros on one device: they depend on no input, so
    nothing carries the parameters' placement to them, and placing them afterwards replicated
    would hold two copies of the weights' size on every device."""
    names = lambda path: tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    placed = {names(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(path, leaf):
        keys = names(path)
        for start in range(len(keys)):
            param = placed.get(keys[start:])
            if param is not None and param.shape == leaf.shape:
                return param.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(place, opt_state)


def placement(state: TrainState, mesh: Mesh):
    """The shardings of `state`'s leaves, with anything not yet placed on `mesh` replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, state
    )
