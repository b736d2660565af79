"""One RL run's fixed parts, apart from its loop (`jspec.jobs.train_rl`): `check`, every check of
a run that needs no device (so a config that cannot run fails before anything is built, and a
cluster's command can be checked off the cluster), and `Run`, what the run builds once (meshes,
policy and draft, tokenizer, shardings, the train step), which the benchmarks of the RL step
build too."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jspec import config as config_lib
from jspec import hosts, pipeline, tokenizers
from jspec import mesh as mesh_lib
from jspec.config import ConfigError
from jspec.models import create, draft_factory, hf
from jspec.rl import meshes, packing, tasks
from jspec.rl.state import Networks, optimizer
from jspec.rl.train import make_train_step
from jspec.sampler.tree_choice import TreeChooser


def check(cfg: config_lib.Config, mode: str, num_devices: int, num_processes: int = 1):
    """Every check of a run that needs no device, so a config that cannot run fails before
    anything is built (and a cluster's command can be checked off the cluster). Returns the
    config with `rollout.eos_id` the tokenizer's when unset, the tokenizer, and the widest
    prompt in tokens."""
    if cfg.rl is None:
        raise ConfigError(
            f"config {cfg.name!r} has no rl section; add one (see configs/demo.yaml)."
        )
    rl = cfg.rl
    tasks.check_tasks(rl.task)
    rl.check_rollout(cfg.rollout)
    if rl.rollout_mesh is not None and cfg.pipeline.stages > 1:
        raise ConfigError(
            "rl.rollout_mesh (asynchronous RL) with a pipelined policy is not supported yet: "
            "the sampler's weights would need the layer order; set pipeline.stages=1."
        )
    if rl.rollout_mesh is not None and num_processes > 1:
        raise ConfigError(
            "rl.rollout_mesh (asynchronous RL) runs in one process for now; on several hosts "
            "leave it unset (synchronous RL on the whole mesh)."
        )
    rl.check_mesh(*meshes.split_sizes(cfg.mesh, rl.rollout_mesh, num_devices))
    if rl.partial_rows and num_processes > 1:
        raise ConfigError(
            f"rl.partial_rows={rl.partial_rows} (partial rollouts) runs in one process for now: "
            "the carried completions would have to stay on their host; set rl.partial_rows=0."
        )
    if mode != "none" and cfg.rollout.draft.kind not in ("eagle3", "mtp", "block"):
        raise ConfigError(
            f"--draft-mode {mode} co-trains or freezes an EAGLE-3 draft, an MTP head or a block "
            f"draft, but rollout.draft.kind={cfg.rollout.draft.kind!r}; set rollout.draft.kind "
            "to eagle3, mtp or block, or pass --draft-mode none."
        )
    if mode != "none":
        draft_factory.check_config(cfg.rollout.draft, cfg.model)
    if rl.tree_costs is not None and mode != "none":
        # The file reads, names its trees and measured at the rollouts' temperature.
        TreeChooser.from_bench(rl.tree_costs, cfg.rollout.temperature)
    policy = _check_policy(cfg)
    tokenizer = tokenizers.load(rl.tokenizer, rl.eos_token, policy)
    if cfg.rollout.eos_id is None:
        cfg = dataclasses.replace(
            cfg, rollout=dataclasses.replace(cfg.rollout, eos_id=tokenizer.eos_id)
        )
    if cfg.model.vocab_size < tokenizer.vocab_size or cfg.rollout.eos_id != tokenizer.eos_id:
        raise ConfigError(
            f"rl.tokenizer={rl.tokenizer!r} needs model.vocab_size >= {tokenizer.vocab_size} "
            f"(got {cfg.model.vocab_size}) and rollout.eos_id={tokenizer.eos_id} or unset (got "
            f"{cfg.rollout.eos_id})."
        )
    return cfg, tokenizer, _check_widths(cfg, tokenizer)


def _check_policy(cfg: config_lib.Config) -> pathlib.Path | None:
    """The model directory of the checkpoint rl.policy names (None: random weights), checked
    against the model section."""
    if cfg.rl.policy is None:
        return None
    if cfg.pipeline.stages > 1:
        raise ConfigError(
            f"rl.policy={cfg.rl.policy!r} with pipeline.stages={cfg.pipeline.stages}: loading a "
            "checkpoint into pipeline stages is not supported yet; set pipeline.stages=1."
        )
    directory = hf.model_directory(cfg.rl.policy)
    hf.check_config(directory, cfg.model)
    return directory


def _check_widths(cfg: config_lib.Config, tokenizer) -> int:
    """The widest prompt of the run's tasks in tokens; an error when the longest worked answer
    does not fit in rollout.max_new_tokens, or a prompt and a response not in the model's
    context."""
    prompts, answers = tasks.widths(cfg.rl.task, tokenizer, cfg.seed)
    new = cfg.rollout.max_new_tokens
    if answers + 1 > new:
        raise ConfigError(
            f"rollout.max_new_tokens={new} cannot hold the task's worked answers of up to "
            f"{answers} tokens plus the end token; raise it to at least {answers + 1}."
        )
    if prompts + new > cfg.model.max_seq_len:
        raise ConfigError(
            f"the task's prompts of up to {prompts} tokens plus rollout.max_new_tokens={new} "
            f"exceed the model's context, model.max_seq_len={cfg.model.max_seq_len}; lower "
            "max_new_tokens or the task's difficulty."
        )
    return prompts


class Run:
    """One run's fixed parts: config, meshes (training, and rollout when split), networks (the
    trainer's, and the sampler's on the rollout mesh), tokenizer, static shapes."""

    def __init__(self, checked: tuple, mode: str, load: bool = True):
        """`checked`: what `check` returned for this mode (the config, tokenizer, prompt width).
        `load`: the policy's initial weights read from rl.policy (a run that resumes from its own
        checkpoint leaves them unread)."""
        cfg, self.tokenizer, self.prompt_width = checked
        self.cfg, self.rl, self.mode = cfg, cfg.rl, mode
        self.mesh, self.rollout_mesh = meshes.split_meshes(cfg.mesh, self.rl.rollout_mesh)
        self.trees = None
        if self.rl.tree_costs is not None and mode != "none":
            self.trees = TreeChooser.from_bench(self.rl.tree_costs, cfg.rollout.temperature)
        self.networks, self.initial_params = self._build(self.mesh, load)
        self.sampler_networks = self.networks
        if self.rollout_mesh is not None:  # the rollout mesh's own graphs; its weights come later
            self.sampler_networks = self._build(self.rollout_mesh, load=False)[0]
        self.rows = NamedSharding(self.mesh, PartitionSpec(mesh_lib.RULES["batch"]))
        self.decode_rows = NamedSharding(self.mesh, PartitionSpec(mesh_lib.RULES["decode_batch"]))
        self.align = 2 * self.mesh.shape[mesh_lib.RULES["seq"]]
        # Sequences a train step takes at most: partial rollouts complete up to K more groups.
        whole = self.rl.sequences_per_row * mesh_lib.axis_size(self.mesh, "batch")
        most = self.rl.batch + self.rl.partial_rows * self.rl.group_size
        self.train_sequences = -(-most // whole) * whole

    def _build(self, mesh, load: bool = True) -> tuple[Networks, dict]:
        """(Networks, params) of the policy and the draft created on `mesh`: the policy loaded
        from rl.policy when `load` and it names one, or pipelined over the mesh's stage axis when
        the config asks for stages, else randomly initialised."""
        cfg = self.cfg
        if load and self.rl.policy is not None:
            policy = hf.load(hf.model_directory(self.rl.policy), mesh, config=cfg.model)
        elif cfg.pipeline.stages > 1:
            policy = pipeline.create(cfg.model, cfg.pipeline, mesh=mesh, seed=cfg.seed)
        else:
            policy = create(cfg.model, mesh=mesh, seed=cfg.seed)
        draft = None
        if self.mode != "none":
            draft = draft_factory.from_config(self.cfg.rollout.draft, policy, mesh=mesh)
        return Networks.split(policy, draft, mesh)

    def sequences(self, count: int) -> slice:
        """This process's sequences of a batch of `count`: those of its packed training rows,
        which must also be the rows of its rollouts (process-major mesh)."""
        per_row = self.rl.sequences_per_row
        rows = hosts.local_rows(self.rows, count // per_row)
        mine = slice(rows.start * per_row, rows.stop * per_row)
        whole_groups = mine.start % self.rl.group_size == 0 == mine.stop % self.rl.group_size
        if count == self.rl.batch and not whole_groups:
            raise ConfigError(
                f"process {jax.process_index()} holds sequences {mine} of the RL batch, which "
                f"cut a group of rl.group_size={self.rl.group_size}; make the batch's share of "
                "each host (rl.batch / processes) a multiple of rl.group_size."
            )
        if count == self.rl.batch and hosts.local_rows(self.decode_rows, count) != mine:
            raise ConfigError(
                f"process {jax.process_index()} samples rows "
                f"{hosts.local_rows(self.decode_rows, count)} but trains on sequences {mine}; "
                "give every host whole training rows: make the mesh's data axis a multiple of "
                "the number of processes."
            )
        return mine

    def put(self, local: packing.PackedBatch, first: int, rows: int) -> packing.PackedBatch:
        """The global packed batch of `rows` rows from this process's rows of it, whose first
        sequence is `first` (sequence indices made global)."""
        local = local._replace(sequence=np.where(local.sequence >= 0, local.sequence + first, -1))
        return hosts.global_tree(self.rows, local, rows)

    def pack(self, *arrays) -> tuple[packing.PackedBatch, int]:
        """This process's packed rows of an RL batch (`arrays`: prompts, their lengths,
        responses, their lengths, log-probabilities, advantages) and the global row count: the
        fewest of rl.packed_rows rows filled by real lengths in whose share every process's
        sequences fit, else a row for every rl.sequences_per_row sequences."""
        rl = self.rl
        pack = lambda rows: packing.pack(
            *arrays, per_row=rl.sequences_per_row, align=self.align, rows=rows
        )
        for count in rl.row_counts(mesh_lib.axis_size(self.mesh, "batch")):
            share = hosts.local_rows(self.rows, count)
            dense = pack(share.stop - share.start)
            if hosts.gather([dense is not None]).all():  # one shape on every process
                return dense, count
        block = hosts.local_rows(self.rows, mesh_lib.axis_size(self.mesh, "batch"))  # this host's
        return pack(None), int(hosts.gather([len(arrays[0])], block).sum()) // rl.sequences_per_row

    def step_fn(self, objective: str, trained, learning_rate: float, num_sequences: int):
        tx = optimizer(self.rl, trained, learning_rate)
        step = make_train_step(
            self.networks,
            tx,
            trained,
            self.rl,
            self.cfg.rollout,
            objective=objective,
            num_sequences=num_sequences,
        )
        return tx, step
