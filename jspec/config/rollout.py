"""How rollouts are generated: sampling, stopping, the draft and the tree it proposes."""

from __future__ import annotations

import dataclasses

from jspec.config.errors import ConfigError, choice
from jspec.config.model import ModelConfig

_TREE_KINDS = ("chain", "static", "dynamic")
_DRAFT_KINDS = ("eagle3", "mtp", "block", "external", "none")
_DECODE_BACKENDS = (
    "auto",
    "xla",
    "pallas",
    "pallas_interpret",
    "pallas_tpu",
    "pallas_tpu_interpret",
)


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """The draft tree each verify step checks.

    kind 'chain': `depth` nodes in a line. 'static': the topology `parents` (parents[i] is node
    i's parent, -1 for a child of the root, parents first). 'dynamic': `total_tokens` nodes over
    `depth` levels, at most `top_k` children a node, shaped by the draft as it drafts.

    With `sampled` (at a temperature above 0: what RL samples at), a node's children are drawn
    from the draft without replacement and verified against its probabilities, and a 'dynamic'
    tree is a sampled chain of `depth` nodes with `total_tokens - depth` siblings beside its
    nodes where the draft is least sure (`jspec.sampler.tree.build_sampled_dynamic_tree`).
    Otherwise (and at temperature 0) children are the draft's top-ranked tokens, verified as
    point masses, and a 'dynamic' tree is EAGLE-2's: `top_k` children of the `top_k` best nodes
    per level, reranked to `total_tokens` nodes. A point-mass node is accepted with the target's
    probability of its one token, a sampled one with 1 - TV(target, draft): at temperature 1 the
    sampled trees accept more than twice as many tokens (docs/sampler.md).
    `verify_budget` bounds the nodes of one verify forward.
    """

    kind: str = "chain"
    depth: int = 4
    parents: tuple[int, ...] | None = None
    top_k: int = 4
    total_tokens: int = 8
    sampled: bool = True
    verify_budget: int = 64

    def sampled_at(self, temperature: float) -> bool:
        """Whether the nodes are drawn from the draft at `temperature`: `sampled`, above 0 (at 0
        the draft's draws are its top-ranked tokens, which the point-mass trees propose)."""
        return self.sampled and temperature > 0

    @property
    def levels(self) -> int:
        """Levels below the root (a static tree's deepest node's depth)."""
        if self.kind != "static":
            return self.depth
        depth: list[int] = []
        for p in self.parents or ():
            depth.append(1 if p < 0 else depth[p] + 1)
        return max(depth, default=0)

    @property
    def num_nodes(self) -> int:
        if self.kind == "static":
            return len(self.parents or ())
        return self.depth if self.kind == "chain" else self.total_tokens

    def validate(self, where: str = "rollout.tree", temperature: float = 1.0) -> None:
        choice(f"{where}.kind", self.kind, _TREE_KINDS)
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
        if self.kind == "dynamic" and self.sampled_at(temperature):
            if not self.depth <= self.total_tokens <= self.depth * self.top_k:
                raise ConfigError(
                    f"{where}.total_tokens={self.total_tokens}: a sampled dynamic tree of "
                    f"depth={self.depth} and top_k={self.top_k} is a chain of {self.depth} nodes "
                    f"with up to {self.top_k - 1} siblings beside each, {self.depth} to "
                    f"{self.depth * self.top_k} nodes; set total_tokens within them."
                )
        elif self.kind == "dynamic":
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
    EAGLE-3 layout) or randomly initialised with a draft vocabulary of the target's first
    `vocab_size` ids (0: the whole vocabulary): in a byte-level BPE the bytes and the earliest,
    most common merges, the demo's bytes and end token. A draft whose vocabulary should be the
    most frequent tokens of a corpus takes `jspec.models.draft.frequent_tokens` as its
    `target_ids` (`create_eagle3`). 'mtp': a multi-token-prediction head on the
    target's final hidden state, sharing its embedding and output head, from `path` (a policy
    directory holding its head in MiMo's layout, `jspec.models.hf_mtp`) or randomly initialised.
    'block': a block draft (DFlash style, `jspec.models.block`) on the target's taps, sharing its
    embedding and output head, from `path` (DFlash's layout, `jspec.models.hf_block`) or randomly
    initialised with `block_layers` decoder layers (the chained head with `block_chained`): it
    predicts `block_size` - 1 tokens in one forward, proposed as a tree of up to `block_size` - 1
    levels.
    'external': a small decoder sharing the target's tokenizer, from `path` (a Hugging Face
    checkpoint) or randomly initialised as `model`.
    'none': plain decoding. A loaded EAGLE-3 draft that carries its own copy of the target's
    embedding is refused when the copy differs from the target's (it was trained for another
    target), unless `allow_other_target`, which loads it with a warning.
    """

    kind: str = "none"
    path: str | None = None
    vocab_size: int = 0
    model: ModelConfig | None = None
    allow_other_target: bool = False
    block_size: int = 8
    block_layers: int = 1
    block_chained: bool = False

    def validate(self, where: str = "rollout.draft") -> None:
        choice(f"{where}.kind", self.kind, _DRAFT_KINDS)
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
        if self.block_size < 2 or self.block_layers < 1:
            raise ConfigError(
                f"{where}.block_size={self.block_size} must be >= 2 (the root and a predicted "
                f"token) and {where}.block_layers={self.block_layers} >= 1."
            )


def check_block_tree(tree: TreeConfig, block_size: int, where: str = "rollout.tree") -> None:
    """Raises ConfigError unless a block draft of `block_size` positions can fill `tree`: a tree
    of at most block_size - 1 levels (its predicted positions, in order)."""
    if tree.levels > block_size - 1:
        raise ConfigError(
            f"{where}: a block draft proposes trees of up to block_size - 1 = {block_size - 1} "
            f"levels, not a {tree.kind} tree of {tree.levels}; set {where} shallower, or raise "
            "rollout.draft.block_size."
        )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which attention kernels rollout queries take against the KV cache; static in the compiled
    rollout, so a change compiles anew.

    Up to `few_queries` queries per row (a decoded token, a verified tree) take the few-query path
    (`impl="decode"`: one read of the cache for all queries of a row); longer prefills take the
    block kernels (0: always the block kernels). The few-query path folds the cache in on
    `decode_backend`: 'auto' the Pallas kernel on an NVIDIA GPU that can run it, the Pallas TPU
    kernel on a TPU, and XLA elsewhere; 'xla', 'pallas' (NVIDIA GPUs), 'pallas_tpu', or either
    kernel in Pallas' interpreter ('pallas_interpret', 'pallas_tpu_interpret': slow, for tests on
    the CPU). With `qkv_kernel`, where that backend is the Pallas GPU kernel, the q/k norms,
    rotary and cache writes after a layer's fused q/k/v product run as one kernel
    (`jspec.models.qkv_epilogue`); otherwise as XLA's fusions.
    """

    few_queries: int = 64
    decode_backend: str = "auto"
    qkv_kernel: bool = True

    def validate(self, where: str = "rollout.kernels") -> None:
        if self.few_queries < 0:
            raise ConfigError(
                f"{where}.few_queries={self.few_queries} must be >= 0 (0: the block kernels only)."
            )
        choice(f"{where}.decode_backend", self.decode_backend, _DECODE_BACKENDS)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A smaller batch that a rollout's live rows move into (compaction) once no prompt waits for
    a row and at most `rows` are still running (as many on every row shard): in RL most responses
    end early and the step waits for the few longest, which decode faster and can afford a deeper
    tree in a batch of their own size. `tree` is the tree they verify there (None: the rollout's).
    """

    rows: int
    tree: TreeConfig | None = None

    def validate(self, where: str, temperature: float) -> None:
        if self.rows < 1:
            raise ConfigError(f"{where}.rows={self.rows} must be >= 1.")
        if self.tree is not None:
            self.tree.validate(f"{where}.tree", temperature)


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
    # Smaller batches the live rows move into as rows finish, largest first; those not below the
    # rows decoded at once are skipped. Each compiles once, in the same program.
    buckets: tuple[Bucket, ...] = ()
    kernels: KernelConfig = KernelConfig()

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
        rows = [b.rows for b in self.buckets]
        if rows != sorted(set(rows), reverse=True):
            raise ConfigError(
                f"{where}.buckets rows={rows} must decrease strictly: each bucket is a smaller "
                "batch than the one before."
            )
        for i, bucket in enumerate(self.buckets):
            bucket.validate(f"{where}.buckets[{i}]", self.temperature)
        self.draft.validate(f"{where}.draft")
        self.tree.validate(f"{where}.tree", self.temperature)
        self.kernels.validate(f"{where}.kernels")
        if self.draft.kind in ("eagle3", "block"):
            model.check_taps()
        for name, tree in self.trees(where) if self.draft.kind == "block" else ():
            check_block_tree(tree, self.draft.block_size, name)

    def trees(self, where: str = "rollout") -> list[tuple[str, TreeConfig]]:
        """(field name, tree) of every tree the rollouts verify: the rollout's, the buckets'."""
        buckets = [(f"{where}.buckets[{i}].tree", b.tree) for i, b in enumerate(self.buckets)]
        return [(f"{where}.tree", self.tree)] + [(n, t) for n, t in buckets if t is not None]
