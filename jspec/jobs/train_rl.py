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
steps and at the last, with the config beside; `jspec.jobs.trainer`, shared with train_code_lm);
the warm start's own in warm_start/ until its end is saved as step 0 of checkpoints/. Run again to
resume from the latest checkpoint. A run that completes writes export/: the policy in
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
from tqdm import tqdm

from jspec import config as config_lib
from jspec import hosts
from jspec.config import ConfigError, RolloutConfig
from jspec.jobs import cli, trainer
from jspec.jobs.export import save_for_serving
from jspec.jobs.rl_run import Run, check
from jspec.rl import grpo, packing, partial, tasks
from jspec.rl.rollouts import Sampler
from jspec.rl.state import init_state, trained_groups
from jspec.sampler import Rollout
from jspec.sampler.arguments import decode_rows, row_shards
from jspec.sampler.generation import compiled_programs, stages

EXPORT = "export"  # RUN_DIR/export/: the policy and draft in the layouts serving engines load
# The warm start's steps are many and short: saved by the clock (and at a limit), not by count.
WARM_START_SAVE_MINUTES = 5.0


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


def warm_start(run: Run, loop: trainer.TrainLoop, log) -> dict:
    """Supervised steps on the task's worked answers; the draft learns the policy's features.
    `loop` (RUN_DIR/warm_start) saves them every few minutes and at a limit, and a rerun resumes
    from its newest checkpoint: batch i is the same in every run."""
    rl, cfg = run.rl, run.cfg
    trained = trained_groups("cotrain", run.networks.draft is not None)
    tx, step = run.step_fn("sft", trained, rl.sft_learning_rate, rl.sft_batch)
    fresh = lambda: init_state(
        run.networks, run.initial_params, tx, trained, seed=cfg.seed, reference=False
    )
    state, done = loop.resume(fresh) or (fresh(), 0)
    width = cfg.rollout.max_new_tokens
    start = time.perf_counter()
    mine = run.sequences(rl.sft_batch)
    for i in range(done, rl.sft_steps):
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
        shown = i % 25 == 0 or i == rl.sft_steps - 1
        if shown:
            values = ", ".join(f"{k} {float(v):.3f}" for k, v in metrics.items())
            log(f"warm start {i}: {values} ({time.perf_counter() - start:.0f} s)")
        loop.step_done(i + 1, state, metrics, flush=shown)
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
    if not rl.sft_steps:  # the state is rl.policy's, which a rerun reads again
        return new(run.initial_params), step
    with warm_loop(loop) as warm:
        state = new(warm_start(run, warm, log))
        loop.save(0, state)
        loop.checkpoints.wait()  # the warm start's checkpoints go once its end is saved
        warm.remove_checkpoints()
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


def warm_loop(loop: trainer.TrainLoop) -> trainer.TrainLoop:
    """The warm start's checkpoints and metrics in RUN_DIR/warm_start: the run's config checked
    against theirs, its limits counting the warm start's steps."""
    config = loop.checkpoints.config
    return trainer.TrainLoop(
        loop.directory / "warm_start",
        config,
        total=config["rl"]["sft_steps"],
        limits=loop.limits,
        keep=1,
        save_minutes=WARM_START_SAVE_MINUTES,
        save_last=False,  # the RL loop saves its end as step 0
        allow_changes=loop.checkpoints.allow_changes,
        log=loop.checkpoints.log,
        name="warm start: ",
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
