"""What an RL run does: the task, GRPO and the draft's co-training, asynchronous rollouts, and
the checks an RL run makes of the rollouts and the mesh."""

from __future__ import annotations

import dataclasses
import math

from jspec.config.errors import ConfigError, choice
from jspec.config.parallel import MeshConfig
from jspec.config.rollout import RolloutConfig

_NORMALIZATIONS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """A verifiable task (`jspec.rl.tasks`): `name` at `difficulty` (digits, list or string
    length), shifted to `shifted_name` / `shifted_difficulty` from RL step `shift_step` on (0:
    never), so the policy is made to move part-way through a run. The names are the keys of
    `jspec.rl.tasks.TASKS`, checked there (`check_task`) when a run is checked.

    `spread` > 0 draws each problem's difficulty from the task's difficulty up to `spread` more,
    each one up `spread_decay` times as likely as the one below (0.5: half as likely): most
    problems easy, a few hard, so that the responses of a step have the long tail of lengths that
    RL rollouts have. Each task has a hardest difficulty (`jspec.rl.tasks.TASKS`), checked with its
    name (`check_tasks`)."""

    name: str = "addition"
    difficulty: int = 2
    shift_step: int = 0
    shifted_name: str | None = None
    shifted_difficulty: int | None = None
    spread: int = 0
    spread_decay: float = 0.5

    def validate(self, where: str = "rl.task") -> None:
        if self.spread < 0:
            raise ConfigError(f"{where}.spread={self.spread} must be >= 0 (0: one difficulty).")
        if not 0 < self.spread_decay <= 1:
            raise ConfigError(
                f"{where}.spread_decay={self.spread_decay} must be in (0, 1]: how much less likely "
                "each harder difficulty is than the one below (1: all equally likely)."
            )
        for field in ("difficulty", "shifted_difficulty"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{field}={value} must be >= 1.")
        if self.shift_step < 0:
            raise ConfigError(f"{where}.shift_step={self.shift_step} must be >= 0 (0: no shift).")
        shifted = [
            f for f in ("shifted_name", "shifted_difficulty") if getattr(self, f) is not None
        ]
        if shifted and not self.shift_step:
            raise ConfigError(
                f"{where}.{shifted[0]} is set but {where}.shift_step=0: the task never shifts; "
                f"set {where}.shift_step to the step it shifts at, or unset {shifted[0]}."
            )


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO with an online co-trained draft (`jspec.rl`).

    A run warm-starts policy and draft by `sft_steps` supervised steps on the task's worked
    answers, then makes `steps` RL steps (0: the warm start alone, exported as a run's end is).
    Each RL step samples `prompts` prompts, `group_size` responses each (the batch is their
    product), packs `sequences_per_row` sequences into each training row, and makes one update of
    policy and draft. With `packed_rows` (empty: off) the rows of an RL step are the fewest of
    these counts that hold its sequences by their real lengths, each row as long (responses mostly
    end before rollout.max_new_tokens, so the train step computes on fewer padded tokens), and a
    step whose sequences fit none of them takes the rows of every sequence at full length. Each
    count is rounded up to a multiple of mesh.data (the rows split over it), and each count taken
    compiles the train step once; the metrics' `packed_rows` says which a step took.

    The draft loss (weight `draft_loss_weight`) runs the trunk pass and `ttt_steps` branch steps
    of the training-time test, step i weighted `ttt_decay`**i, in chunks of `loss_chunk` tokens
    along the sequence, on `draft_rows` of the step's training rows (0: all of them; else rows
    spread evenly over each data shard's, rounded up to a multiple of the data shards): the
    draft's passes cost a share of the policy's that grows as the policy is shallower, and a
    subset of each step's fresh rollouts bounds it. The policy's log-probabilities run the
    output head over `vocab_chunks` slices of the vocabulary at a time (`jspec.models.output_head`;
    it must divide the vocabulary): 1 keeps the [B,T,V] logits whole, fastest where they fit;
    more bound them to 1/vocab_chunks of that for one more product of the head's size in the
    backward (long rows, large vocabularies). The draft's teacher reads the policy's hidden
    states, never its logits.
    Policy and draft have their own learning rate and gradient clipping, each reached by a linear
    warmup from 0 over `warmup_steps` of the warm start and again of RL: the optimizer's moments
    start from 0 in each, and Adam's first updates (about the learning rate on every weight,
    whatever the gradient's size) would otherwise jolt a policy and draft that are already trained.
    Every `samples_every` steps (0: never) the first response of each of the step's first two groups
    goes with its reward to RUN_DIR/samples.jsonl: what the policy writes, to read beside the
    metrics.
    `kl_coef` > 0 keeps a frozen reference policy (after the SFT warm start).

    Asynchronous RL: `rollout_mesh` (fixed axis sizes) gives the last devices to the sampler and
    `mesh` the rest to the trainer; the rollouts of step n are generated with the weights of step
    n - `max_lag` while the trainer runs the steps before (0: synchronous, the same loop).
    `partial_rows` = K > 0 (partial rollouts, one process): a step's rollout returns once at most
    K rows still run, and those completions go on in the next step's rollout under its weights;
    a group trains in the step in which its last completion ends (`jspec.rl.partial`).

    `tree_costs`: a JSON of `jspec/bench/rollout.py` (speculative steps timed on this machine, at
    the rollouts' temperature); each rollout batch then verifies the tree that pays most at its
    batch size, by those costs and the accepted lengths rollouts measure, or decodes plainly, and
    each of `rollout.buckets` the tree that pays most at its rows (`jspec.sampler.tree_choice`).
    None: always `rollout.tree` (and the buckets' own).

    `policy`: the checkpoint the policy starts from, a Hugging Face directory (config.json,
    safetensors, tokenizer.json) or a `train_code_lm` run directory (its target/); the `model`
    section must describe it (`jspec.models.hf.check_config`). None: random weights (the toy
    demo). The draft starts from `rollout.draft.path` or fresh.

    `tokenizer`: 'bytes' (the toy demo's byte tokenizer) or the path of a `tokenizer.json`; None:
    the policy checkpoint's, or 'bytes' without one. Responses end at `eos_token` (None: the token
    its tokenizer_config.json names; `jspec.tokenizers`); `rollout.eos_id`, when unset, is that
    token's id.
    """

    task: TaskConfig = TaskConfig()
    policy: str | None = None
    tokenizer: str | None = None
    eos_token: str | None = None
    steps: int = 40
    prompts: int = 8
    group_size: int = 8
    sequences_per_row: int = 4
    packed_rows: tuple[int, ...] = ()
    draft_rows: int = 0
    sft_steps: int = 300
    sft_batch: int = 64
    learning_rate: float = 1e-4
    sft_learning_rate: float = 3e-3
    draft_learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    draft_max_grad_norm: float = 1.0
    clip_epsilon: float = 0.2
    kl_coef: float = 0.0
    normalization: str = "token"
    draft_loss_weight: float = 1.0
    ttt_steps: int = 6
    ttt_decay: float = 0.8
    loss_chunk: int = 64
    vocab_chunks: int = 1
    save_every: int = 10
    samples_every: int = 10
    keep_checkpoints: int = 3
    max_lag: int = 0
    partial_rows: int = 0
    rollout_mesh: MeshConfig | None = None
    tree_costs: str | None = None

    @property
    def batch(self) -> int:
        return self.prompts * self.group_size

    def row_counts(self, shards: int) -> list[int]:
        """`packed_rows` for rows split `shards` ways (the data axis), in order: each count
        rounded up to a multiple of `shards`, so a config for one device runs on more."""
        return sorted({-(-count // shards) * shards for count in self.packed_rows})

    def validate(self, where: str = "rl") -> None:
        self.task.validate(f"{where}.task")
        names = ("prompts", "sequences_per_row", "sft_batch", "loss_chunk", "keep_checkpoints")
        for name in (*names, "vocab_chunks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 1.")
        if self.group_size < 2:
            raise ConfigError(
                f"{where}.group_size={self.group_size}: group-relative advantages need at least 2 "
                "responses per prompt."
            )
        for name in (
            "steps",
            "sft_steps",
            "kl_coef",
            "draft_loss_weight",
            "ttt_steps",
            "save_every",
            "samples_every",
            "warmup_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 0.")
        positive = ("learning_rate", "sft_learning_rate", "draft_learning_rate", "clip_epsilon")
        for name in (*positive, "max_grad_norm", "draft_max_grad_norm"):  # 0 or less: no step
            value, finite = getattr(self, name), name in positive  # a norm may be inf: no clip
            if not value > 0 or (finite and not math.isfinite(value)):
                raise ConfigError(f"{where}.{name}={value} must be > 0{' and finite' * finite}.")
        full = self.batch // self.sequences_per_row
        for count in self.packed_rows:
            if not 1 <= count <= full:
                raise ConfigError(
                    f"{where}.packed_rows={list(self.packed_rows)}: {count} must be in [1, batch / "
                    f"sequences_per_row = {full}] (an empty list: every sequence at full length)."
                )
        rows = min(self.packed_rows, default=full)
        if not 0 <= self.draft_rows <= rows:
            raise ConfigError(
                f"{where}.draft_rows={self.draft_rows} must be in [0, {rows}], the fewest training "
                f"rows of a step ({where}.packed_rows, else batch / sequences_per_row; 0: all)."
            )
        if self.batch % self.sequences_per_row:
            raise ConfigError(
                f"{where}.sequences_per_row={self.sequences_per_row} does not divide the batch "
                f"{where}.prompts * {where}.group_size = {self.batch}; pick a divisor of it."
            )
        choice(f"{where}.normalization", self.normalization, _NORMALIZATIONS)
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
        if not 0 <= self.partial_rows < self.prompts:
            raise ConfigError(
                f"{where}.partial_rows={self.partial_rows} must be in [0, {self.prompts}) (fewer "
                f"than {where}.prompts, so every step trains on a group): rows a step's rollout "
                "may leave running (0: every rollout runs to its end)."
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
        if self.partial_rows and 0 < rollout.rows <= self.partial_rows:
            raise ConfigError(
                f"rl.partial_rows={self.partial_rows} leaves that many rows running, so "
                f"rollout.rows={rollout.rows} must be more (or 0: a row for every prompt)."
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
        if self.partial_rows % decode:
            raise ConfigError(
                f"rl.partial_rows={self.partial_rows}: the carried completions decode in rows of "
                f"their own, which split over the {decode} rollout shards ({where}.data * "
                f"{where}.context); make it a multiple of {decode}."
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
