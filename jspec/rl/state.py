"""TrainState: everything a run changes, as one pytree, and its orbax checkpoints.

The policy and draft parameters are plain nested dicts (`nnx.to_pure_dict`), so optax, orbax and
`jit` see ordinary pytrees; `Networks` holds the static rest (graph definitions, the draft's
vocabulary map) and turns parameters back into modules inside `jit`. The sampler reads the same
TrainState the train step writes: there is no weight sync.

Optimizers: one `optax.multi_transform` with a group per parameter set, each with its own learning
rate and gradient clipping (the draft's gradients are clipped apart from the policy's). A frozen
draft is not in the optimizer at all.

Randomness: `rng` is one key; each step's rollout key is `fold_in(rng, step)`, so a resumed run
draws what the uninterrupted run drew. Under SPMD `jit` a global key gives every data-parallel rank
different bits for its own rows and every tensor or context replica the same bits for the same
rows, which is what seeding per data-parallel rank is for (replicas never diverge).

Checkpoints (`Checkpoints`): orbax `CheckpointManager`, async saves, the run's config saved beside
each state as JSON. Resuming reads the latest step whose state restores, before anything is
compiled: a config changed in a way that breaks the resume is refused, and a corrupt checkpoint is
set aside (the step is then saved anew) and the one before it used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import traceback
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
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
    rest: Any  # non-parameter state (the draft's vocabulary map), constant

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

    def shardings(self, params: dict) -> dict:
        """NamedShardings of params by their logical axes (`jspec.mesh.RULES`)."""
        out = {}
        for name, net in (("policy", self.policy), ("draft", self.draft)):
            if name in params:
                state = jax.tree.unflatten(net.treedef, jax.tree.leaves(params[name]))
                out[name] = nnx.to_pure_dict(param_shardings(state, self.mesh))
        return out


def optimizer(rl: RLConfig, trained: tuple[str, ...], policy_learning_rate: float):
    """One multi_transform over the trained groups: AdamW after per-group norm clipping."""
    groups = {
        "policy": (policy_learning_rate, rl.max_grad_norm),
        "draft": (rl.draft_learning_rate, rl.draft_max_grad_norm),
    }
    transforms = {
        name: optax.chain(optax.clip_by_global_norm(groups[name][1]), optax.adamw(groups[name][0]))
        for name in trained
    }
    labels = lambda params: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}
    return optax.multi_transform(transforms, labels)


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


# ---------------------------------------------------------------------------------------------
# Checkpoints.

# Config fields a checkpoint's state is shaped by: a resume that changes them cannot restore.
SHAPED_BY = ("model", "draft_mode", "rollout.draft", "pipeline")
# Config fields a resume may change and still continue as the uninterrupted run would have.
SAFE_TO_CHANGE = ("name", "rl.steps", "rl.save_every", "rl.keep_checkpoints")


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (saved value, current value)} of the fields that differ."""
    saved, current = _flat(saved), _flat(current)
    keys = sorted(set(saved) | set(current))
    return {k: (saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)}


def _under(field: str, sections: tuple[str, ...]) -> bool:
    return any(field == s or field.startswith(s + ".") for s in sections)


@contextlib.contextmanager
def _output_to(log: pathlib.Path):
    """Everything written to the process's stderr (orbax's and TensorStore's reports of a failed
    read: thousands of lines) goes to the end of `log` instead."""
    _log_stray_callbacks(log)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("a") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


class Checkpoints:
    """Async orbax checkpoints of TrainState, with the run's config (a JSON dict) beside each.

    Resuming (`restore_latest`) reads the newest checkpoint that restores. One that does not
    (truncated, garbled, half deleted) is moved out of the way, to `corrupt/` beside the
    checkpoints, with one line saying why (the reader's full report goes to `checkpoints.log`):
    the run then saves that step anew, and retention (the newest `keep`) only ever counts
    checkpoints that restore. A checkpoint written with a different config is refused when the
    state's shapes follow the change (`SHAPED_BY`), or when the run would no longer continue as the
    uninterrupted one would have, unless `allow_changes`; changes in `SAFE_TO_CHANGE` are accepted.
    Each accepted change is logged."""

    def __init__(
        self,
        directory: str | pathlib.Path,
        config: dict,
        keep: int = 3,
        *,
        allow_changes: bool = False,
        log=lambda msg: print(msg, file=sys.stderr),
    ):
        self.directory = pathlib.Path(directory).resolve()
        self.config = json.loads(json.dumps(config))  # JSON types, as it will be read back
        self.keep, self.allow_changes, self.log = keep, allow_changes, log
        self.log_file = self.directory.parent / "checkpoints.log"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "config")
        )

    def save(self, step: int, state: TrainState) -> None:
        """Starts an async save (returns once the arrays are copied off the devices)."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config)
            ),
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def check_config(self, saved: dict, step: int) -> str:
        """Raises ConfigError when checkpoint `step` (config `saved`) cannot or should not be
        resumed with this run's config; the changes it accepts, described ('' for none)."""
        changes = changed_fields(saved, self.config)
        where = f"checkpoint step {step} in {self.directory}"
        describe = lambda fields: ", ".join(
            f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in fields
        )
        shaped = [k for k in changes if _under(k, SHAPED_BY)]
        if shaped:
            raise ConfigError(
                f"{where} was written with another model or draft ({describe(shaped)}); resume "
                "with the config it was written with, or start a new run directory."
            )
        exact = [k for k in changes if not _under(k, SAFE_TO_CHANGE)]
        if exact and not self.allow_changes:
            raise ConfigError(
                f"{where} was written with {describe(exact)}; with a changed value the run "
                "would not continue as it was. Resume with the saved values, pass "
                "--allow-config-change to continue with the new ones, or start a new run "
                "directory."
            )
        return describe(sorted(changes))

    def check_resume(self) -> None:
        """`check_config` against the newest checkpoint whose config reads, so that a resume the
        config refuses fails before anything is built (`restore_latest` checks again)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                saved = self._restore_config(step)
            except Exception:  # noqa: BLE001 - restore_latest sets it aside
                continue
            self.check_config(saved, step)
            return

    def restore_latest(self, template: TrainState) -> TrainState | None:
        """The newest checkpoint that restores (None: there is none), placed like `template`.
        A checkpoint written with another config is an error; one that fails to read is moved
        aside and the one before it tried."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                saved = self._restore_config(step)
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is set aside
                self._set_aside(step, error)
                continue
            changes = self.check_config(saved, step)
            try:
                with _output_to(self.log_file):
                    restored = self.manager.restore(
                        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
                    )
            except Exception as error:  # noqa: BLE001
                self._set_aside(step, error)
                continue
            self.log(f"resuming from step {step} in {self.directory}")
            if changes:
                self.log(f"resuming with a changed config: {changes}")
            return TrainState(*restored.state)
        return None

    def _restore_config(self, step: int) -> dict:
        with _output_to(self.log_file):
            args = ocp.args.Composite(config=ocp.args.JsonRestore())
            return self.manager.restore(step, args=args).config

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves unreadable checkpoint `step` to `corrupt/` (process 0, once every process has
        failed to read it), so that the step can be saved again."""
        aside = self.directory.parent / "corrupt" / f"{step}"
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
        self.log(
            f"checkpoint step {step} does not restore ({reason}); moved to {aside}, details in "
            f"{self.log_file}"
        )
        _barrier(f"jspec checkpoint {step} unreadable")
        if jax.process_index() == 0:
            aside.parent.mkdir(parents=True, exist_ok=True)
            if aside.exists():
                shutil.rmtree(aside)
            shutil.move(str(self.directory / f"{step}"), aside)
        _barrier(f"jspec checkpoint {step} set aside")
        self.manager.reload()


def _log_stray_callbacks(log: pathlib.Path) -> None:
    """After a failed read, TensorStore's callbacks still land, one per array, on the read's event
    loop, closed by then: Python reports each as an unraisable 'Event loop is closed' (thousands
    of tracebacks in the terminal). Those go to `log`; any other unraisable error as before."""
    default = sys.unraisablehook
    if getattr(default, "jspec_log", None) == log:
        return

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(
            unraisable.exc_value
        ):
            with log.open("a") as f:
                traceback.print_exception(unraisable.exc_value, file=f)
        else:
            default(unraisable)

    hook.jspec_log = log
    sys.unraisablehook = hook


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
