"""Configs: frozen dataclasses, loaded from YAML, overridden by dotted `key=value` arguments.

One `Config` describes a run: the model, the mesh it runs on, and what the run does with it. Every
field is validated once, in Python, before anything is traced or compiled, and every error names
the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml


def _config_dir() -> pathlib.Path:
    """The named configs: the top-level configs/, installed as the package data of jspec.configs
    (so `load("demo")` works from any folder), or read beside the package in a source checkout
    that was not installed."""
    try:
        return pathlib.Path(str(importlib.resources.files("jspec.configs")))
    except ModuleNotFoundError:
        return pathlib.Path(__file__).resolve().parent.parent / "configs"


CONFIG_DIR = _config_dir()


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM of the Llama 3 / Qwen3 / Qwen3-MoE families.

    `tap_layers` are the layers whose *input* hidden states an EAGLE-3 draft consumes; None means
    the EAGLE-3 default, the inputs of layers 2, L//2 and L-3, or (0, L//2, L-1) for models of 3 to
    6 layers, where that default would repeat a layer. Only a model with a draft attached needs
    them (`check_taps`), so any layer count loads.

    Mixture of experts (Qwen3-MoE; `num_experts=0` is a dense model): layer i has a sparse MLP of
    `num_experts` experts of width `moe_intermediate_size`, each token routed to
    `num_experts_per_tok` of them, iff `i not in mlp_only_layers` and `(i + 1) %
    decoder_sparse_step == 0` (as `transformers` decides); other layers keep the dense MLP of width
    `intermediate_size`. `norm_topk_prob` renormalises the chosen experts' router probabilities to
    sum to 1. `router_aux_loss_coef` is the weight the training loss gives the load-balancing loss.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    tap_layers: tuple[int, ...] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "full"
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the mixture of experts."""
        return tuple(
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def taps(self) -> tuple[int, ...]:
        if self.tap_layers is not None:
            return tuple(self.tap_layers)
        n = self.num_layers
        return (2, n // 2, n - 3) if n >= 7 else (0, n // 2, n - 1)

    def check_taps(self, where: str = "model") -> None:
        """Three distinct tap layers in range: what an EAGLE-3 draft needs of its target."""
        taps = self.taps
        bad = [t for t in taps if not 0 <= t < self.num_layers]
        if len(taps) != 3 or bad or len(set(taps)) != 3:
            raise ConfigError(
                f"{where}.tap_layers={taps}: an EAGLE-3 draft needs 3 distinct layer indices in "
                f"[0, {self.num_layers}); "
                + (
                    f"a model of {self.num_layers} layers has fewer than 3, so use another draft "
                    "kind (external) or none."
                    if self.num_layers < 3
                    else f"set {where}.tap_layers explicitly, or leave it unset for the default."
                )
            )

    def validate(self, where: str = "model") -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{where}.{name}={value} must be positive.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{where}.num_heads={self.num_heads} is not a multiple of "
                f"{where}.num_kv_heads={self.num_kv_heads}; grouped-query attention needs "
                "num_heads = k * num_kv_heads."
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"{where}.head_dim={self.head_dim} must be even: rotary embeddings rotate pairs."
            )
        s = self.rope_scaling
        if s is not None and s.high_freq_factor <= s.low_freq_factor:
            raise ConfigError(
                f"{where}.rope_scaling.high_freq_factor={s.high_freq_factor} must exceed "
                f"low_freq_factor={s.low_freq_factor} (Llama 3 uses 4.0 and 1.0)."
            )
        taps = self.tap_layers or ()
        if any(not 0 <= t < self.num_layers for t in taps) or len(set(taps)) != len(taps):
            raise ConfigError(
                f"{where}.tap_layers={self.tap_layers} must be distinct layer indices in "
                f"[0, {self.num_layers})."
            )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16", "float16"):
                raise ConfigError(
                    f"{where}.{name}={value!r} is not one of 'float32', 'bfloat16', 'float16'."
                )
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"{where}.remat={self.remat!r} is not one of 'none', 'full', 'dots'.")
        self._validate_experts(where)

    def _validate_experts(self, where: str) -> None:
        if self.num_experts < 0:
            raise ConfigError(
                f"{where}.num_experts={self.num_experts} must be 0 (a dense model) or positive."
            )
        if self.decoder_sparse_step < 1:
            raise ConfigError(
                f"{where}.decoder_sparse_step={self.decoder_sparse_step} must be at least 1 (1: "
                "every layer not in mlp_only_layers is sparse; 2: every second one)."
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(
                f"{where}.mlp_only_layers={self.mlp_only_layers} names layers {bad} outside "
                f"[0, {self.num_layers}); list indices of dense layers of this model."
            )
        if self.router_aux_loss_coef < 0:
            raise ConfigError(
                f"{where}.router_aux_loss_coef={self.router_aux_loss_coef} must be non-negative "
                "(Qwen3-MoE uses 0.001)."
            )
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{where}.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"{where}.num_experts={self.num_experts}."
            )
        if self.moe_intermediate_size <= 0:
            raise ConfigError(
                f"{where}.moe_intermediate_size={self.moe_intermediate_size} must be positive "
                f"when {where}.num_experts={self.num_experts}: it is the width of each expert's "
                "MLP (Qwen3-30B-A3B uses 768)."
            )


_TREE_KINDS = ("chain", "static", "dynamic")
_DRAFT_KINDS = ("eagle3", "external", "none")


def _choice(where: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(repr, allowed))}.")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """The draft tree each verify step checks.

    kind 'chain': `depth` nodes in a line. 'static': the topology `parents` (parents[i] is node
    i's parent, -1 for a child of the root, parents first). With `sampled`, chain and static
    children are drawn from the draft and verified against its probabilities; otherwise they are
    the draft's top-ranked tokens, verified as point masses. 'dynamic': an EAGLE-2 tree, `top_k`
    children of the `top_k` best nodes per level for `depth` levels, reranked to `total_tokens`
    nodes (point masses). `verify_budget` bounds the nodes of one verify forward.
    """

    kind: str = "chain"
    depth: int = 4
    parents: tuple[int, ...] | None = None
    top_k: int = 4
    total_tokens: int = 8
    sampled: bool = True
    verify_budget: int = 64

    @property
    def num_nodes(self) -> int:
        if self.kind == "static":
            return len(self.parents or ())
        return self.depth if self.kind == "chain" else self.total_tokens

    def validate(self, where: str = "rollout.tree") -> None:
        _choice(f"{where}.kind", self.kind, _TREE_KINDS)
        if self.kind == "static":
            parents = self.parents or ()
            bad = [i for i, p in enumerate(parents) if not -1 <= p < i]
            if not parents or bad:
                raise ConfigError(
                    f"{where}.parents={self.parents}: a static tree needs at least one node, and "
                    "each parent must be -1 (the root) or an earlier node's index"
                    + (f"; parents[{bad[0]}]={parents[bad[0]]} is not." if bad else ".")
                )
        else:
            for name in ("depth",) + (("top_k", "total_tokens") if self.kind == "dynamic" else ()):
                if getattr(self, name) < 1:
                    raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 1.")
        if self.kind == "dynamic":
            pool = self.top_k + (self.depth - 1) * self.top_k**2
            if self.total_tokens > pool:
                raise ConfigError(
                    f"{where}.total_tokens={self.total_tokens} exceeds the {pool} candidates that "
                    f"top_k={self.top_k} and depth={self.depth} propose; lower total_tokens or "
                    "raise top_k or depth."
                )
        if self.num_nodes > self.verify_budget:
            raise ConfigError(
                f"{where}: a {self.kind} tree of {self.num_nodes} nodes exceeds "
                f"{where}.verify_budget={self.verify_budget}; shrink the tree or raise the budget."
            )


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The draft model that proposes trees.

    kind 'eagle3': an EAGLE-3 head on the target's taps, from `path` (a checkpoint in the public
    EAGLE-3 layout) or randomly initialised with a draft vocabulary of `vocab_size` most frequent
    tokens (0: the target's whole vocabulary). 'external': a small decoder sharing the target's
    tokenizer, from `path` (a Hugging Face checkpoint) or randomly initialised as `model`.
    'none': plain decoding. A loaded EAGLE-3 draft that carries its own copy of the target's
    embedding is refused when the copy differs from the target's (it was trained for another
    target), unless `allow_other_target`, which loads it with a warning.
    """

    kind: str = "none"
    path: str | None = None
    vocab_size: int = 0
    model: ModelConfig | None = None
    allow_other_target: bool = False

    def validate(self, where: str = "rollout.draft") -> None:
        _choice(f"{where}.kind", self.kind, _DRAFT_KINDS)
        if self.kind == "external" and self.path is None and self.model is None:
            raise ConfigError(
                f"{where}.kind='external' needs {where}.path (a Hugging Face checkpoint) or "
                f"{where}.model (a model config to initialise randomly)."
            )
        if self.model is not None:
            self.model.validate(f"{where}.model")
        if self.vocab_size < 0:
            raise ConfigError(
                f"{where}.vocab_size={self.vocab_size} must be >= 0 (0: the target's vocabulary)."
            )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are generated: sampling, stopping, and the draft and tree that speed them up."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_id: int | None = None
    draft: DraftConfig = DraftConfig()
    tree: TreeConfig = TreeConfig()
    # Rows decoded at once (0: every prompt). With fewer rows than prompts, a row whose completion
    # ends takes the next prompt (continuous batching): rows do not idle until the slowest is done.
    rows: int = 0
    # Prompts prefilled together into free rows, the rows' first prompts too: a prefill's
    # activations are of this many rows. A refill waits until that many rows are free. 0: every
    # row at once when every prompt has a row, else a row in 8 (at least one per row shard).
    refill_rows: int = 0

    def validate(self, model: ModelConfig, where: str = "rollout") -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"{where}.max_new_tokens={self.max_new_tokens} must be >= 1.")
        if not self.temperature >= 0:
            raise ConfigError(
                f"{where}.temperature={self.temperature} must be >= 0 (0 is greedy decoding)."
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{where}.top_p={self.top_p} must be in (0, 1] (1 disables top-p).")
        if self.top_k < 0:
            raise ConfigError(f"{where}.top_k={self.top_k} must be >= 0 (0 disables top-k).")
        if self.eos_id is not None and not 0 <= self.eos_id < model.vocab_size:
            raise ConfigError(
                f"{where}.eos_id={self.eos_id} is not a token of the vocabulary of size "
                f"{model.vocab_size}; use the tokenizer's end-of-sequence id, or none."
            )
        for name in ("rows", "refill_rows"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"{where}.{name}={getattr(self, name)} must be >= 0 (0: chosen for you)."
                )
        if self.rows and self.refill_rows > self.rows:
            raise ConfigError(
                f"{where}.refill_rows={self.refill_rows} exceeds {where}.rows={self.rows}: a "
                "refill fills free rows; lower refill_rows or raise rows."
            )
        self.draft.validate(f"{where}.draft")
        self.tree.validate(f"{where}.tree")
        if self.draft.kind == "eagle3":
            model.check_taps()


_TASK_NAMES = ("addition", "sorting", "counting")  # jspec.rl.tasks.TASKS; checked there too
_NORMALIZATIONS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """A verifiable task (`jspec.rl.tasks`): `name` at `difficulty` (digits, list or string
    length), shifted to `shifted_name` / `shifted_difficulty` from RL step `shift_step` on (0:
    never), so the policy is made to move part-way through a run."""

    name: str = "addition"
    difficulty: int = 2
    shift_step: int = 0
    shifted_name: str | None = None
    shifted_difficulty: int | None = None

    def validate(self, where: str = "rl.task") -> None:
        for field, value in (("name", self.name), ("shifted_name", self.shifted_name)):
            if value is not None and value not in _TASK_NAMES:
                close = difflib.get_close_matches(value, _TASK_NAMES, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{where}.{field}={value!r} is not a task; use one of "
                    f"{', '.join(map(repr, _TASK_NAMES))}.{hint}"
                )
        for field in ("difficulty", "shifted_difficulty"):
            value = getattr(self, field)
            if value is not None and not 1 <= value <= 8:
                raise ConfigError(f"{where}.{field}={value} must be in [1, 8].")
        if self.shift_step < 0:
            raise ConfigError(f"{where}.shift_step={self.shift_step} must be >= 0 (0: no shift).")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO with an online co-trained draft (`jspec.rl`).

    Each RL step samples `prompts` prompts, `group_size` responses each (the batch is their
    product), packs `sequences_per_row` sequences into each training row, and makes one update of
    policy and draft. The draft loss (weight `draft_loss_weight`) runs the trunk pass and
    `ttt_steps` branch steps of the training-time test, step i weighted `ttt_decay`**i, in chunks of
    `loss_chunk` tokens along the sequence. Policy and draft have their own learning rate and
    gradient clipping. `kl_coef` > 0 keeps a frozen reference policy (after the SFT warm start).

    Asynchronous RL: `rollout_mesh` (fixed axis sizes) gives the last devices to the sampler and
    `mesh` the rest to the trainer; the rollouts of step n are generated with the weights of step
    n - `max_lag` while the trainer runs the steps before (0: synchronous, the same loop).

    `tree_costs`: a JSON of `jspec/bench/rollout.py` (speculative steps timed on this machine);
    each rollout batch then verifies the tree that pays most at its batch size, by those costs and
    the accepted lengths rollouts measure, or decodes plainly (`jspec.sampler.tree_choice`). None:
    always `rollout.tree`.

    `tokenizer`: 'bytes' (the toy demo's byte tokenizer) or the path of a `tokenizer.json`, whose
    responses end at `eos_token` (`jspec.tokenizers`); `rollout.eos_id`, when unset, is that
    token's id.
    """

    task: TaskConfig = TaskConfig()
    tokenizer: str = "bytes"
    eos_token: str | None = None
    steps: int = 40
    prompts: int = 8
    group_size: int = 8
    sequences_per_row: int = 4
    sft_steps: int = 300
    sft_batch: int = 64
    learning_rate: float = 1e-4
    sft_learning_rate: float = 3e-3
    draft_learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    draft_max_grad_norm: float = 1.0
    clip_epsilon: float = 0.2
    kl_coef: float = 0.0
    normalization: str = "token"
    draft_loss_weight: float = 1.0
    ttt_steps: int = 6
    ttt_decay: float = 0.8
    loss_chunk: int = 64
    save_every: int = 10
    keep_checkpoints: int = 3
    max_lag: int = 0
    rollout_mesh: MeshConfig | None = None
    tree_costs: str | None = None

    @property
    def batch(self) -> int:
        return self.prompts * self.group_size

    def validate(self, where: str = "rl") -> None:
        self.task.validate(f"{where}.task")
        for name in ("steps", "prompts", "sequences_per_row", "sft_batch", "loss_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 1.")
        if self.group_size < 2:
            raise ConfigError(
                f"{where}.group_size={self.group_size}: group-relative advantages need at least 2 "
                "responses per prompt."
            )
        for name in ("sft_steps", "kl_coef", "draft_loss_weight", "ttt_steps", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 0.")
        for name in ("learning_rate", "sft_learning_rate", "draft_learning_rate", "clip_epsilon"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be > 0.")
        if self.batch % self.sequences_per_row:
            raise ConfigError(
                f"{where}.sequences_per_row={self.sequences_per_row} does not divide the batch "
                f"{where}.prompts * {where}.group_size = {self.batch}; pick a divisor of it."
            )
        _choice(f"{where}.normalization", self.normalization, _NORMALIZATIONS)
        if not 0 < self.ttt_decay <= 1:
            raise ConfigError(f"{where}.ttt_decay={self.ttt_decay} must be in (0, 1].")
        self._validate_async(where)

    def _validate_async(self, where: str) -> None:
        """The fields of asynchronous RL: the lag, and a rollout mesh of fixed sizes."""
        if self.max_lag < 0:
            raise ConfigError(
                f"{where}.max_lag={self.max_lag} must be >= 0: 0 is synchronous RL, k >= 1 lets "
                "the rollouts run on weights up to k steps older than the trainer's."
            )
        if self.max_lag and self.rollout_mesh is None:
            raise ConfigError(
                f"{where}.max_lag={self.max_lag} needs {where}.rollout_mesh: rollouts run ahead of "
                "the trainer on devices of their own (e.g. rl.rollout_mesh.data=4 gives the last 4 "
                f"devices to the sampler); set it, or {where}.max_lag=0 for synchronous RL."
            )
        for axis, size in dataclasses.asdict(self.rollout_mesh or MeshConfig(data=1)).items():
            if size < 1:
                raise ConfigError(
                    f"{where}.rollout_mesh.{axis}={size}: the rollout mesh takes a fixed number "
                    "of devices, so every axis needs a size >= 1 (the training mesh, `mesh`, "
                    "takes the devices left over)."
                )

    def check_rollout(self, rollout: RolloutConfig) -> None:
        """Raises ConfigError for rollouts GRPO cannot learn from (checked by an RL run only, so
        the same config still decodes greedily elsewhere)."""
        if rollout.temperature <= 0 or rollout.top_p != 1 or rollout.top_k != 0:
            raise ConfigError(
                f"rollout.temperature={rollout.temperature}, top_p={rollout.top_p}, "
                f"top_k={rollout.top_k}: GRPO needs sampled rollouts whose log-probabilities the "
                "train step recomputes exactly; set rollout.temperature > 0, top_p=1, top_k=0."
            )

    def check_mesh(self, sizes: dict[str, int], rollout: dict[str, int] | None = None) -> None:
        """Raises ConfigError when the batch does not split over the meshes (before compiling):
        rollout rows over data x context of the rollout mesh (`rollout`; None: the training
        mesh's `sizes`), packed training rows over data."""
        where = "mesh" if rollout is None else "rl.rollout_mesh"
        rollout = sizes if rollout is None else rollout
        decode = rollout["data"] * rollout["context"]
        rows = self.batch // self.sequences_per_row
        if self.batch % decode:
            raise ConfigError(
                f"the RL batch rl.prompts * rl.group_size = {self.prompts} * {self.group_size} = "
                f"{self.batch} does not split over the {decode} rollout shards ({where}.data * "
                f"{where}.context = {rollout['data']} * {rollout['context']}); make it a multiple "
                f"of {decode}, e.g. rl.prompts={-(-decode // math.gcd(decode, self.group_size))}."
            )
        if rows % sizes["data"]:
            raise ConfigError(
                f"the {rows} packed training rows (batch {self.batch} / rl.sequences_per_row="
                f"{self.sequences_per_row}) do not split over mesh.data={sizes['data']}; lower "
                "rl.sequences_per_row or raise rl.prompts so the rows are a multiple of it."
            )
        sft_rows, rem = divmod(self.sft_batch, self.sequences_per_row)
        if rem or sft_rows % sizes["data"]:
            raise ConfigError(
                f"rl.sft_batch={self.sft_batch} must be a multiple of rl.sequences_per_row * "
                f"mesh.data = {self.sequences_per_row} * {sizes['data']}, so its packed rows "
                "split over the data axis."
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; -1 on one axis means 'all devices left over'."""

    data: int = -1
    stage: int = 1
    context: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism of the policy's training forward (`jspec.pipeline`): the layers cut in
    `stages` stages, one per rank of mesh axis `stage`, each stage holding `repeats` chunks of
    consecutive layers (circular schedule: more repeats, smaller bubble), the batch cut in
    `microbatches`. stages=1 is no pipeline."""

    stages: int = 1
    microbatches: int = 1
    repeats: int = 1

    def validate(self, model: ModelConfig, mesh: MeshConfig, where: str = "pipeline") -> None:
        for name in ("stages", "microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 1.")
        if mesh.stage not in (-1, self.stages):
            raise ConfigError(
                f"mesh.stage={mesh.stage} but {where}.stages={self.stages}: each rank of the stage "
                f"axis runs one stage; set mesh.stage={self.stages} or {where}.stages={mesh.stage}."
            )
        chunks = self.stages * self.repeats
        if model.num_layers % chunks:
            raise ConfigError(
                f"model.num_layers={model.num_layers} is not divisible by {where}.stages * "
                f"{where}.repeats = {self.stages} * {self.repeats}; choose stages and repeats "
                f"whose product divides {model.num_layers}."
            )
        if self.repeats > 1 and self.microbatches < self.stages:
            raise ConfigError(
                f"{where}.microbatches={self.microbatches} < {where}.stages={self.stages}: with "
                f"{where}.repeats={self.repeats} a microbatch re-enters stage 0 before the next "
                f"has left it; use at least {self.stages} microbatches or repeats=1."
            )
        if self.stages > 1 and model.num_experts > 0:
            raise ConfigError(
                f"{where}.stages={self.stages} with model.num_experts={model.num_experts}: the "
                "pipeline runs dense models only; set pipeline.stages=1 for a mixture of experts."
            )

    def check_rows(self, rows: int, where: str = "pipeline") -> None:
        """Raises ConfigError unless `rows` training rows cut into the microbatches."""
        if rows % self.microbatches:
            raise ConfigError(
                f"{rows} training rows do not cut into {where}.microbatches={self.microbatches}; "
                f"choose a divisor of {rows} (each microbatch must also split over mesh.data)."
            )


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    name: str = "tiny"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    rollout: RolloutConfig = RolloutConfig()
    rl: RLConfig | None = None
    pipeline: PipelineConfig = PipelineConfig()

    def validate(self) -> Config:
        self.model.validate("model")
        self.rollout.validate(self.model)
        self.pipeline.validate(self.model, self.mesh)
        if self.rl is not None:
            self.rl.validate()
            self.pipeline.check_rows(self.rl.batch // self.rl.sequences_per_row)
        return self


# ---------------------------------------------------------------------------------------------
# Loading and overrides.


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: Any, where: str) -> Any:
    """Builds dataclass `cls` from a nested dict, checking names and coercing scalar types."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of fields, got {data!r}.")
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(types_), n=1)
        prefix = f"{where}." if where else ""
        hint = f"; did you mean {prefix}{close[0]}?" if close else "."
        raise ConfigError(
            f"unknown config field {prefix}{name}{hint} Known fields: {', '.join(types_)}."
        )
    kwargs = {
        name: _coerce(types_[name], value, f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, Sequence):
            raise ConfigError(f"{where}={value!r} must be a list.")
        (elem, *_) = typing.get_args(tp)
        return tuple(_coerce(elem, v, where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{where}={value!r} is not a boolean; use true or false.")
    if tp in (int, float):
        try:
            out = tp(value) if tp is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} is not {tp.__name__}.") from None
        return out
    if tp is str:
        return str(value)
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is a value, not a section.")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> dict:
    """Turns `["model.num_layers=4", "seed=1"]` into a nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} has no '='; write overrides as dotted.key=value, "
                "e.g. model.num_layers=4."
            )
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """A config name (`tiny`) shipped in `configs/`, or a path to a YAML file."""
    path = pathlib.Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"config {str(name_or_path)!r} not found at {path}; pass a YAML path or one of: "
            f"{', '.join(known)}."
        )
    return path


def load(name_or_path: str | pathlib.Path = "tiny", overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config, applies dotted overrides, validates, and returns a frozen Config."""
    path = resolve_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("name", path.stem)
    data = _merge(data, parse_overrides(overrides))
    return _build(Config, data, "").validate()


def to_dict(config: Any) -> dict:
    """The plain nested dict of a config (for logs, checkpoints and YAML)."""
    return dataclasses.asdict(config)
