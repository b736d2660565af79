"""RL with speculative rollouts and an online co-trained draft: SFT warm start, then GRPO.

    python -m jspec.jobs.train_rl                      # configs/demo.yaml, co-trained
    python -m jspec.jobs.train_rl --draft-mode frozen       # the draft stops learning after SFT
    python -m jspec.jobs.train_rl --draft-mode none         # plain decoding, no draft
    python -m jspec.jobs.train_rl rl.steps=60 rl.task.shift_step=30 rl.task.shifted_difficulty=3
    python -m jspec.jobs.train_rl rl.max_lag=1 rl.rollout_mesh.data=4   # asynchronous, 4 + 4
    python -m jspec.jobs.train_rl --config code-rl rl.policy=runs/code \
        rollout.draft.path=runs/code/draft         # train_code_lm's model and draft, the code task

The policy starts from random weights (the toy demo), or from a checkpoint (rl.policy: a Hugging
Face directory, or a train_code_lm run directory) with its tokenizer.json; the draft from
rollout.draft.path (the public EAGLE-3 layout) or fresh. The warm start trains the policy on the
task's worked answers and the draft on the policy's own features (the same train step, a supervised
objective), so RL starts from a policy that sometimes succeeds and a draft that is already useful.
Each RL step then draws prompts, samples a group of responses per prompt with
`jspec.sampler.generate` (the draft of the current TrainState proposes, the policy verifies),
scores them exactly, and makes one update of policy and draft.

Asynchronous RL (`train`): with rl.rollout_mesh the last devices sample and the rest train; with
rl.max_lag = k >= 1 the rollouts of step n + 1 run while step n trains, on weights k steps old (the
loss's importance ratio uses the log-probabilities recorded under them), and the new policy and
draft weights move to the sampler after each train step, device to device.

On many hosts (`jspec-launch train_rl ...`, jspec.jobs.distributed) each process builds, samples
and scores only the rows its devices hold (`jspec.hosts`); process 0 writes metrics and logs, and
every process takes part in each orbax checkpoint (the run directory must be shared).

Writes to --run-dir (default runs/<config>-<draft> in the working directory): metrics.jsonl (one
line per RL step: reward, losses, draft agreement, mean accepted length, rollout tokens/s, rollout /
scoring / packing / train / weight transfer / step time, the lag of the batch's weights in steps),
TensorBoard events when tensorboardX is installed, and checkpoints/ (async, every rl.save_every
steps and at the last, with the config beside; `jspec.jobs.trainer`, shared with train_code_lm).
Run again to resume from the latest checkpoint. A run that completes writes export/: the policy in
the Hugging Face layout with its tokenizer, and the draft in the public EAGLE-3 layout, for a
serving engine (`--export` writes the latest checkpoint's at any time). `--stop-after MINUTES` (a
time limit) and `--stop-after-steps N` stop the run early with its step saved and exit status 75;
the same command resumes it. `jspec/jobs/plot_runs.py` draws several runs' metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from concurrent.futures import Future
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jspec import config as config_lib
from jspec import hosts, pipeline, tokenizers
from jspec import mesh as mesh_lib
from jspec.config import ConfigError, RolloutConfig
from jspec.jobs import cli, trainer
from jspec.jobs.export import save_for_serving
from jspec.models import create, draft_factory, hf
from jspec.rl import grpo, meshes, packing, partial, tasks
from jspec.rl.rollouts import Sampler
from jspec.rl.state import Networks, init_state, optimizer, trained_groups
from jspec.rl.train import make_train_step
from jspec.sampler import Rollout
from jspec.sampler.generation import compiled_programs, decode_rows, row_shards, stages
from jspec.sampler.tree_choice import TreeChooser

EXPORT = "export"  # RUN_DIR/export/: the policy and draft in the layouts serving engines load


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=60")
    p.add_argument("--config", default="demo", help="config name in configs/ or a YAML path")
    p.add_argument("--draft-mode", default="cotrain", choices=("cotrain", "frozen", "none"))
    p.add_argument("--run-dir", default=None, help="default: runs/<config>-<draft>")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no progress lines")
    p.add_argument(
        "--export",
        action="store_true",
        help=f"write the latest checkpoint's policy and draft to RUN_DIR/{EXPORT}/ and exit (a run "
        "that completes exports itself)",
    )
    trainer.add_arguments(p)  # --stop-after MINUTES, --stop-after-steps N, --allow-config-change
    cli.add_compilation_cache_argument(p)
    return p.parse_intermixed_args(argv)


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


def warm_start(run: Run, log) -> dict:
    """Supervised steps on the task's worked answers; the draft learns the policy's features."""
    rl, cfg = run.rl, run.cfg
    trained = trained_groups("cotrain", run.networks.draft is not None)
    tx, step = run.step_fn("sft", trained, rl.sft_learning_rate, rl.sft_batch)
    state = init_state(
        run.networks, run.initial_params, tx, trained, seed=cfg.seed, reference=False
    )
    width = cfg.rollout.max_new_tokens
    start = time.perf_counter()
    mine = run.sequences(rl.sft_batch)
    for i in range(rl.sft_steps):
        batch = tasks.problems(rl.task, 0, rl.sft_batch, cfg.seed, stream=1 + i)[mine]
        prompts, prompt_lengths = tasks.encode_prompts(run.tokenizer, batch, run.prompt_width)
        answers, answer_lengths = tasks.encode_answers(run.tokenizer, batch, width)
        packed = packing.pack(
            prompts,
            prompt_lengths,
            answers,
            answer_lengths,
            per_row=rl.sequences_per_row,
            align=run.align,
        )
        state, metrics = step(
            state, run.put(packed, mine.start, rl.sft_batch // rl.sequences_per_row)
        )
        if i % 25 == 0 or i == rl.sft_steps - 1:
            values = ", ".join(f"{k} {float(v):.3f}" for k, v in metrics.items())
            log(f"warm start {i}: {values} ({time.perf_counter() - start:.0f} s)")
    return state.params


class InFlight(NamedTuple):
    """Rollouts dispatched for RL step `step` with weights of `version` train steps; `rows`: this
    process's sequences of the batch."""

    step: int
    version: int
    # The trees `Run.trees` chose, stage by stage ((None,): as configured, or plain decoding).
    trees: tuple[str | None, ...]
    rows: slice
    group: list  # this process's problems, one per sequence
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    out: Future  # of a Rollout (of `Sampler.generate_partial`'s tuple with partial rollouts)
    start: float


def step_prompts(run: Run, step: int) -> tuple[list, np.ndarray, np.ndarray]:
    """This process's problems of RL step `step`, one per sequence (whole groups: it encodes,
    and later scores and packs, its own rows only), and their prompts encoded with their
    lengths."""
    rl = run.rl
    problems = tasks.problems(rl.task, step, rl.prompts, run.cfg.seed)
    group = [p for p in problems for _ in range(rl.group_size)][run.sequences(rl.batch)]
    return (group, *tasks.encode_prompts(run.tokenizer, group, run.prompt_width))


def start_rollout(run: Run, sampler: Sampler, step: int, made=None) -> InFlight:
    """Dispatches a group of sampled responses to each prompt of `step` (`made`: its
    `step_prompts`, if made ahead)."""
    rl, mine = run.rl, run.sequences(run.rl.batch)
    group, prompts, prompt_lengths = made or step_prompts(run, step)
    config, trees, speculative = run.cfg.rollout, (None,), True
    if run.trees is not None:
        config, trees = choose_trees(run, config)
        speculative = trees != (None,)
    start = time.perf_counter()
    if rl.partial_rows:  # the carried completions in rows beside the batch's
        out = sampler.generate_partial(group, prompts, prompt_lengths, step, config, speculative)
    else:
        out = sampler.generate(prompts, prompt_lengths, rl.batch, step, config, speculative)
    return InFlight(step, sampler.version, trees, mine, group, prompts, prompt_lengths, out, start)


def choose_trees(run: Run, config: RolloutConfig) -> tuple[RolloutConfig, tuple[str | None, ...]]:
    """The rollout config with the trees `run.trees` picks by the rows of each of its stages
    (the bench timed one device: its batch is the rows per device), and their names: (None,)
    for plain decoding, where no tree pays at the whole batch."""
    shards, keep = row_shards(run.rollout_mesh or run.mesh), run.rl.partial_rows
    rows = decode_rows(config, run.rl.batch + keep)  # the carried completions' rows too
    name, tree = run.trees.pick(rows // shards)
    if name is None:
        return config, (None,)
    below = [run.trees.pick_tree(r // shards) for r, _ in stages(config, rows, keep)[1:]]
    buckets = [b for b in config.buckets if keep < b.rows < rows]  # the stages' own, in order
    picked = [dataclasses.replace(b, tree=t) for b, (_, t) in zip(buckets, below, strict=True)]
    names = (name, *(n for n, _ in below))
    return dataclasses.replace(config, tree=tree, buckets=tuple(picked)), names


def finish_rollout(run: Run, job: InFlight):
    """Waits for the rollouts of `job`, scores the sequences they complete; the packed batch, the
    step's metrics (over the whole batch), the samples to show and the snapshot of the partial
    rollouts' pool after them (None without)."""
    rl = run.rl
    out, done, generated, snapshot = completed(run, job)
    seconds = time.perf_counter() - job.start
    score_start = time.perf_counter()
    responses = [
        run.tokenizer.decode(t[:n]) for t, n in zip(done.tokens, done.lengths, strict=True)
    ]
    rewards = tasks.rewards_by_step(rl.task, done.steps, done.problems, responses)
    pack_start = time.perf_counter()
    advantages = grpo.group_advantages(rewards, rl.group_size)
    arrays = (done.prompts, done.prompt_lengths, done.tokens, done.lengths, done.logprobs)
    # Empty sequences after: a batch's worth, or (past it) the most partial rollouts complete.
    size = len(job.group) if len(rewards) <= len(job.group) else run.train_sequences
    grow = lambda x: np.pad(x, [(0, size - len(x))] + [(0, 0)] * (x.ndim - 1))
    packed, rows = run.pack(*(grow(np.asarray(x)) for x in (*arrays, advantages)))
    batch = run.put(packed, job.rows.start, rows)
    name, difficulty = tasks.task_at(rl.task, job.step)
    stats = type(out.stats)(*hosts.gather_global(tuple(out.stats)))
    all_rewards, all_lengths = (hosts.gather(x, job.rows) for x in (rewards, done.lengths))
    accepted = stats.mean_accepted_length() if run.mode != "none" else 1.0
    if run.trees is not None and job.trees == (None,):  # plain decoding, its buckets included
        run.trees.observe(None, stats.tokens_per_row_step())
    elif run.trees is not None:  # each stage's tree, where it ran
        for stage, tree in enumerate(job.trees):
            if int(stats.row_steps[stage]):
                run.trees.observe(tree, stats.tokens_per_row_step(stage))
    tokens = int(hosts.gather([generated], job.rows).sum())
    metrics = {
        "reward": float(all_rewards.mean()),
        "accepted_length": accepted,
        "busy": stats.busy(),
        "response_length": float(all_lengths.mean()),
        "rollout_tokens": tokens,
        "rollout_tokens_per_s": tokens / seconds,
        "rollout_time": seconds,
        "verify_steps": int(np.max(stats.iterations)),  # loop trips: the rollout's longest chain
        "score_time": pack_start - score_start,
        "pack_time": time.perf_counter() - pack_start,  # advantages, packing, to the devices
        "lag": job.step - job.version,
        "rollout_programs": compiled_programs(),  # one per tree chosen (buckets are stages)
        # Per stage (the batch, then each bucket): rows decoded summed over its loop trips, and
        # tokens emitted: how long each bucket ran and what its tree earned a row per trip.
        "stage_row_steps": [int(x) for x in stats.row_steps],
        "stage_emitted": [int(x) for x in stats.emitted],
        "task": f"{name}:{difficulty}" + (f"-{difficulty + rl.task.spread}" * bool(rl.task.spread)),
    }
    if rl.packed_rows:
        metrics["packed_rows"] = rows
    if rl.partial_rows:
        metrics |= partial.metrics(done, out.finished, job.step, rl.group_size)
    if run.trees is not None:
        metrics["tree"] = " > ".join(tree or "plain" for tree in job.trees)  # stage by stage
    # The first response of each of the first two groups, to read what the policy writes.
    shown = [
        {"step": done.steps[i], "reward": float(rewards[i]), "response": responses[i]}
        for i in range(0, min(len(responses), 2 * rl.group_size), rl.group_size)
    ]
    return batch, metrics, shown, snapshot


def completed(run: Run, job: InFlight) -> tuple[Rollout, partial.Trained, int, bytes | None]:
    """The rollout of `job`, this process's sequences it completes, the tokens it generated, and
    the partial rollouts' pool after it (None without them: every sequence of the batch)."""
    if run.rl.partial_rows:
        return job.out.result()
    out = job.out.result()
    steps, host = [job.step] * len(job.group), [hosts.host_rows(x, job.rows) for x in out[:3]]
    done = partial.Trained(job.group, steps, job.prompts, job.prompt_lengths, *host)
    return out, done, int(host[1].sum()), None


def start_or_resume(run: Run, loop: trainer.TrainLoop, log):
    """The TrainState to continue from: the latest good checkpoint, else a fresh warm start."""
    rl, cfg = run.rl, run.cfg
    trained = trained_groups(run.mode, run.networks.draft is not None)
    tx, step = run.step_fn("grpo", trained, rl.learning_rate, run.train_sequences)
    new = lambda params: init_state(
        run.networks, params, tx, trained, seed=cfg.seed, reference=rl.kl_coef > 0
    )
    if (restored := loop.resume(lambda: new(run.initial_params))) is not None:
        return restored[0], step
    state = new(warm_start(run, log))
    if rl.sft_steps:  # else the state is rl.policy's, which a rerun reads again
        loop.save(0, state)
    return state, step


def train(run: Run, state, train_step, loop: trainer.TrainLoop, quiet: bool):
    """The RL loop, synchronous or asynchronous, from the steps `state` has done to rl.steps (or
    a limit of the run: `loop` saves and stops it). The rollouts of step s are generated with the
    weights of step max(s - rl.max_lag, first step); those of the steps ahead are dispatched
    before this step's train step (from the sampler's thread), so on the rollout mesh they run
    while it trains: nothing waits for them until their own step. After each train step its policy
    and draft weights go to the sampler. rl.max_lag=0 is the synchronous loop."""
    rl, first = run.rl, int(state.step)
    last = loop.limits.last_step(first, rl.steps)  # unless the time limit comes first
    pool, snapshots = resume_pool(run, loop, first, quiet)
    if run.trees is not None:  # as the checkpoint left them: a resumed run picks the same trees
        run.trees.resume(loop.beside("trees.json", first))
        loop.keep_beside("trees.json", lambda done: run.trees.dumps())
    sampler = Sampler(run.sampler_networks, run.networks, pool)
    sampler.load(state, first)
    inflight: dict[int, InFlight] = {}
    made = {}  # step_prompts of the next step to dispatch, made while the device trains
    bar = tqdm(range(first, rl.steps), initial=first, total=rl.steps, disable=quiet)
    try:
        for step in bar:
            start = time.perf_counter()
            for ahead in range(step, min(step + rl.max_lag, last - 1) + 1):
                if ahead not in inflight:
                    inflight[ahead] = start_rollout(run, sampler, ahead, made.pop(ahead, None))
            batch, metrics, shown, snapshots[step] = finish_rollout(run, inflight.pop(step))
            snapshots.pop(step - 2, None)
            if rl.samples_every and step % rl.samples_every == 0 and hosts.is_main():
                with loop.metrics_path.with_name("samples.jsonl").open("a") as f:
                    f.writelines(json.dumps(sample) + "\n" for sample in shown)
            train_start = time.perf_counter()
            update = train_step(state, batch)  # dispatched: the host is free while it runs
            if (following := step + rl.max_lag + 1) < last:
                made[following] = step_prompts(run, following)
            state, train_metrics = jax.block_until_ready(update)
            metrics["train_time"] = time.perf_counter() - train_start
            metrics["transfer_time"] = sampler.load(state, step + 1)
            metrics.update({k: float(v) for k, v in jax.device_get(train_metrics).items()})
            metrics["step_time"] = time.perf_counter() - start
            bar.set_postfix(
                reward=f"{metrics['reward']:.2f}", accepted=f"{metrics['accepted_length']:.2f}"
            )
            loop.step_done(step + 1, state, metrics)
    finally:
        sampler.close()
    return state


def resume_pool(run: Run, loop: trainer.TrainLoop, first: int, quiet: bool):
    """The pool of partial rollouts that the checkpoint of step `first` carries on (None without
    partial rollouts), and the snapshots of the pool after each step's rollout, by step, which
    the loop saves beside each checkpoint."""
    rl, snapshots, new = run.rl, {}, run.cfg.rollout.max_new_tokens
    if not rl.partial_rows:
        return None, snapshots
    pool = partial.Pool(rl.partial_rows, run.prompt_width, new, rl.group_size)
    if not pool.resume(loop.beside("partial.pkl", first)) and first and not quiet:
        print(f"no partial rollouts saved at step {first}: none carried on", file=sys.stderr)
    snapshots[first - 1] = pool.snapshot()
    loop.keep_beside("partial.pkl", lambda done: snapshots[done - 1])
    return pool, snapshots


def export(run: Run, state, directory: pathlib.Path, say) -> None:
    """The policy and draft of `state` in the layouts serving engines load
    (`jspec.jobs.export`)."""
    if run.cfg.pipeline.stages > 1:
        say(f"{directory}: not written; exporting a pipelined policy is not supported yet.")
        return
    policy, draft = run.networks.models(state.params)
    save_for_serving(policy, draft, run.tokenizer, directory, source=run.rl.policy)
    what = "the policy" if draft is None else "the policy and draft"
    say(f"exported {what} of step {int(state.step)} to {directory}")


def run_loop(args, cfg: config_lib.Config, run_dir: pathlib.Path, limits, say):
    """The run's `trainer.TrainLoop`: checkpoints (its config checked against theirs), metrics,
    limits."""
    rl = cfg.rl
    return trainer.TrainLoop(
        run_dir,
        {**config_lib.to_dict(cfg), "draft_mode": args.draft_mode},
        total=rl.steps,
        limits=limits,
        keep=rl.keep_checkpoints,
        save_every=rl.save_every,
        allow_changes=args.allow_config_change,
        log=say,
    )


def main(argv=None) -> pathlib.Path:
    args = parse_args(argv)
    limits = trainer.Limits.from_args(args)  # --stop-after counts from here
    say, log = cli.messengers(args.quiet)
    cli.use_compilation_cache(args.compilation_cache)
    cfg = config_lib.load(args.config, args.overrides)
    checked = check(cfg, args.draft_mode, jax.device_count(), jax.process_count())
    cfg, rl = checked[0], checked[0].rl
    run_dir = cli.run_directory(
        pathlib.Path(args.run_dir or pathlib.Path("runs") / f"{cfg.name}-{args.draft_mode}")
    )
    loop = run_loop(args, cfg, run_dir, limits, say)
    with trainer.resumable(say), loop:
        if args.export and not loop.checkpoints.steps():
            raise ConfigError(f"--export: {run_dir} holds no checkpoint to export; train first.")
        run = Run(checked, args.draft_mode, load=not loop.checkpoints.steps())
        state, train_step = start_or_resume(run, loop, log)
        if args.export:
            export(run, state, run_dir / EXPORT, say)
            return run_dir
        if (first := int(state.step)) >= rl.steps:
            say(
                f"{run_dir}: warm-started (rl.steps=0)"
                if rl.steps == 0
                else f"{run_dir}: already complete at step {first} (rl.steps={rl.steps}); "
                "raise rl.steps to train on."
            )
            if not (run_dir / EXPORT).is_dir():
                export(run, state, run_dir / EXPORT, say)
            return run_dir
        log(
            f"metrics: {loop.metrics_path}; checkpoints: {loop.checkpoints.directory} (every "
            f"{rl.save_every} steps, the last {rl.keep_checkpoints} kept)"
        )
        log(
            f"step {first} compiles the rollout and the train step; the time estimate settles "
            "after it"
        )
        state = train(run, state, train_step, loop, args.quiet or not hosts.is_main())
        export(run, state, run_dir / EXPORT, say)
    return run_dir


if __name__ == "__main__":
    sys.exit(cli.run(main))
