"""A target language model and its draft (EAGLE-3, an MTP head the target ships, or a block draft),
from scratch on Python source code, so that speculative decoding's acceptance (and so its speedup)
is measured on a real model.

No model hub is reachable from the GPU machines; the `.py` files of the Python installation
(standard library and site-packages: tens of MB of real code) are. The script
  1. splits the files into training and held-out files (by a hash of the path: stable),
  2. trains a byte-level BPE tokenizer on the training files (`tokenizers`),
  3. trains the target (`--config`, 1.4B parameters for `code-1b`) by next-token cross-entropy on
     packed rows of whole files (attention never crosses a file boundary); with `--mtp-weight W`
     (and `--draft-kind mtp`) its MTP head from the first step too, W times the head's loss added
     (on the trunk's features as they are: the head does not shape the trunk),
  4. trains the draft (`--draft-kind`) on the frozen target's features and distribution with the
     co-training loss of `jspec.rl.draft_loss` (the training-time test): an EAGLE-3 draft on its
     taps, a multi-token-prediction head on its final hidden state, or a block draft (DFlash
     style) on its taps, every position of its block; for --draft-steps, or for --draft-minutes
     of training (the same time for every kind compared),
  5. reports held-out loss (nats per token, bits per byte) and the draft's top-1 agreement, and
     writes tokenizer, target and draft to `--run-dir`: target/ in the Hugging Face layout with
     the tokenizer (`train_rl rl.policy=RUN_DIR` starts RL from it), draft/ in the public EAGLE-3
     layout, or mtp/: the target again with its head beside it in MiMo's layout, a policy that
     ships its head (`rl.policy=RUN_DIR/mtp rollout.draft.kind=mtp rollout.draft.path=RUN_DIR/mtp`),
     or block/ in DFlash's layout (`rollout.draft.kind=block rollout.draft.path=RUN_DIR/block`;
     block-chained/ with `--draft-kind block-chained`, the chained head of `jspec.models.block`).
     Run again with another --draft-kind on the same RUN_DIR, the target stage is loaded and the
     new draft trained beside the others; report.json's `drafts` lists each one's steps, seconds
     and agreement.
Both stages split the batch over every device (`--data-parallel`; parameters replicated). Each
stage trains through `jspec.jobs.trainer` (as train_rl does) in `RUN_DIR/training/<stage>/`:
checkpoints/ every `--save-minutes` (a run that dies resumes from the newest checkpoint of the
stage it was in; one that does not restore is moved to corrupt/ there; a finished stage is loaded,
not trained again; the stage's flags and the corpus's are checked on resume, as train_rl checks its
config, `--allow-config-change` lets a change through) and metrics.jsonl (loss, and the draft's
agreement, each step). Under a time limit (a job's, a lent machine's), `--stop-after MINUTES`
saves the stage's step at that time and exits with status 75, as `--stop-after-steps N` does after
N steps of the run; the same command resumes.
`python -m jspec.bench.rollout --trained RUN_DIR` then measures plain and speculative
decoding on prompts from the held-out files.

    python -m jspec.jobs.train_code_lm --run-dir runs/code-1b             # on a GPU
    python -m jspec.jobs.train_code_lm --config tiny model.vocab_size=512 --steps 4 \
        --draft-steps 2 --batch 2 --seq-len 128 --max-bytes 2000000 --run-dir /tmp/code  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec import tokenizers
from jspec.config import ConfigError, MeshConfig
from jspec.jobs import cli, plan_devices, trainer
from jspec.jobs.code_corpus import EOS, Corpus, read_corpus, sampler
from jspec.jobs.plan import Figures
from jspec.models import create, hf, hf_block, hf_eagle3, hf_mtp
from jspec.models.block import BlockConfig, create_block
from jspec.models.draft import Eagle3Config, Shared, create_eagle3
from jspec.models.mtp import MTPConfig, create_mtp
from jspec.rl.draft_loss import draft_loss
from jspec.rl.state import Group, adamw

WARMUP_STEPS = 20  # of a draft trained for --draft-minutes, to its constant learning rate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="code-1b")
    p.add_argument("--run-dir", required=True)
    p.add_argument(
        "--roots",
        nargs="*",
        help="folders of .py files (default: the stdlib and site-packages of this Python)",
    )
    p.add_argument("--max-bytes", type=cli.at_least(1), default=200_000_000, help="corpus size cap")
    p.add_argument("--heldout", type=cli.at_least(2), default=20, help="one file in N is held out")
    p.add_argument("--steps", type=cli.at_least(1), default=600)
    p.add_argument("--batch", type=cli.at_least(1), default=8)
    p.add_argument(
        "--data-parallel",
        type=cli.at_least(0),
        default=0,
        help="devices the batch is split over (0: every device); --batch must be a multiple",
    )
    p.add_argument("--seq-len", type=cli.at_least(2), default=2048)
    p.add_argument("--learning-rate", type=cli.positive, default=6e-4)
    p.add_argument(
        "--draft-kind",
        choices=("eagle3", "mtp", "block", "block-chained"),
        default="eagle3",
        help="the draft trained on the frozen target: EAGLE-3 (its taps), an MTP head (its final "
        "hidden state, its embedding and output head) or a block draft (DFlash style: its taps, "
        "a block of 8 in one forward; block-chained: with the chained head)",
    )
    p.add_argument(
        "--mtp-weight",
        type=cli.at_least(0.0, float),
        default=0.0,
        help="with --draft-kind mtp: train the head with the target from its first step, its loss "
        "weighted so in the target's (0: the head is trained after, on the frozen target)",
    )
    p.add_argument("--draft-steps", type=cli.at_least(0), default=300)
    p.add_argument(
        "--draft-minutes",
        type=cli.positive,
        default=None,
        help="train the draft for this many minutes of its steps (at most --draft-steps), at a "
        "constant learning rate after 20 steps of warmup: drafts of every kind given the same "
        "minutes are trained for the same time",
    )
    p.add_argument("--draft-learning-rate", type=cli.positive, default=1e-3)
    p.add_argument("--ttt-steps", type=cli.at_least(0), default=3)
    p.add_argument("--eval-batches", type=cli.at_least(1), default=16)
    p.add_argument(
        "--save-minutes",
        type=cli.at_least(0.0, float),
        default=4.0,
        help="minutes between checkpoints of a stage in training (a run that dies resumes from "
        "the newest; a save of the 1.4B target and its optimizer state writes about 17 GB)",
    )
    trainer.add_arguments(p)  # --stop-after MINUTES, --stop-after-steps N, --allow-config-change
    args = p.parse_args(argv)
    if args.mtp_weight and args.draft_kind != "mtp":
        raise ConfigError(
            f"--mtp-weight={args.mtp_weight} trains an MTP head with the target: it may be > 0 "
            f"only with --draft-kind mtp (got --draft-kind {args.draft_kind})."
        )
    return args


# ---------------------------------------------------------------------------------------------
# Training.


def next_token_loss(logits, tokens, segment_ids) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy of each token's successor within its file, and the count."""
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    return jnp.sum(jnp.where(same, nll, 0.0)), jnp.sum(same)


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
    """A model's training: its name (its folder in the run directory), steps and learning rate,
    its loss `(module, teacher, batch) -> (loss, metric)` and the metric's name in metrics.jsonl,
    the flags its steps depend on besides `DATA_FLAGS` (checked on resume), and how the trained
    module is saved (`save(path, module)`) and loaded (`load(path) -> module`)."""

    name: str
    steps: int
    learning_rate: float
    loss: Callable
    metric: str
    flags: tuple[str, ...]
    save: Callable
    load: Callable
    minutes: float | None = None  # a time budget: the steps it takes, at a constant rate


# The flags every stage's steps depend on: the corpus, the batches, the devices that split them.
DATA_FLAGS = ("roots", "max_bytes", "heldout", "batch", "seq_len", "data_parallel")


def stage_loop(run: pathlib.Path, args, model, stage: Stage, limits) -> trainer.TrainLoop:
    """The checkpoints (every --save-minutes and at a limit, the newest kept) and metrics of
    `stage` in `run`/training/<stage>, its config (model and flags) checked against theirs."""
    flags = {k: getattr(args, k) for k in (*DATA_FLAGS, *stage.flags)}
    return trainer.TrainLoop(
        run / "training" / stage.name,
        {"model": config_lib.to_dict(model), "flags": flags},
        total=stage.steps,
        limits=limits,
        keep=1,
        save_minutes=args.save_minutes,
        save_last=False,  # the stage is saved whole instead
        allow_changes=args.allow_config_change,
        log=lambda msg: print(f"{stage.name}: {msg}", flush=True),
        name=f"{stage.name}: ",
        shaped_by=("model",),
        safe_to_change=(),
    )


def fit(stage: Stage, module, batches, mesh, loop: trainer.TrainLoop, teacher=None):
    """Trains the Params of `module` on `stage.loss` over the data-parallel `mesh`, the teacher
    (a module, or None) frozen, from the newest checkpoint of `loop` if any; returns the trained
    module (the arrays of `module`'s own Params are consumed: donated to the first step, or freed
    where a checkpoint is restored). Batch i is the same in every run, so a run resumed after step
    n continues as the run that died would have."""
    name = stage.name
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    params = {name: params}  # the optimizer's one group
    teacher_def, teacher_state = nnx.split(teacher)
    if stage.minutes is None:  # warmup and cosine decay over the stage's steps
        group = Group(stage.learning_rate, 1.0, weight_decay=0.1, schedule_steps=stage.steps)
    else:  # to stop at any step: a constant rate after the warmup
        group = Group(stage.learning_rate, 1.0, weight_decay=0.1, warmup_steps=WARMUP_STEPS)
    opt = adamw({name: group})

    def step(params, opt_state, teacher_state, batch):  # jitted by `compiled_to_fit`
        teacher = nnx.merge(teacher_def, teacher_state)
        f = lambda p: stage.loss(nnx.merge(graphdef, p[name], rest), teacher, batch)
        (loss, metric), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metric

    # replicated, as the parameters are on the data-parallel mesh (the step count too, else born
    # on one device, and so restored there)
    replicated = NamedSharding(mesh, PartitionSpec())
    fresh = lambda: dict(params=params, opt_state=jax.device_put(opt.init(params), replicated))
    resumed = loop.resume(fresh)  # (a template: its optimizer state freed once restored)
    if resumed is not None:
        jax.tree.map(lambda x: x.delete(), params)  # the module's first weights, not needed
    state, done = resumed or (fresh(), 0)
    params, opt_state = state["params"], state["opt_state"]
    start, every = time.perf_counter(), max(stage.steps // 20, 1)
    last, spent = start, spent_seconds(loop, done)
    for i in range(done, stage.steps):
        if stage.minutes is not None and trainer.agreed(spent >= 60 * stage.minutes):
            print(f"{name}: {stage.minutes:g} minutes of training after {i} steps", flush=True)
            break
        args = (params, opt_state, teacher_state, batches(i))
        if i == done:
            step = compiled_to_fit(step, args, replicated, name)
        params, opt_state, loss, metric = step(*args)
        if stage.minutes is not None:  # the budget counts device time: wait for each step
            jax.block_until_ready(loss)
        shown = i % every == 0 or i == stage.steps - 1
        if shown:
            print(
                f"{name} step {i:5d}  loss {float(loss):.4f}  {float(metric):.4f}  "
                f"{time.perf_counter() - start:7.1f} s",
                flush=True,
            )
        state = dict(params=params, opt_state=opt_state)
        # Host seconds since the step before (a shown step waits for the device, and under a
        # time budget every step does): summed, the stage's training time; a run's first step,
        # which compiles, apart.
        now = time.perf_counter()
        timed = "seconds" if i > done else "compile_seconds"
        metrics = {"loss": loss, stage.metric: metric, timed: now - last}
        spent += (now - last) * (i > done)
        last = now
        loop.step_done(i + 1, state, metrics, flush=shown)
    loop.flush()  # every step's metrics written before the stage is saved whole
    return nnx.merge(graphdef, params[name], rest)


def compiled_to_fit(step, args, replicated: NamedSharding, name: str):
    """`step` (params, optimizer state, teacher's state, batch -> the first two, loss, metric)
    compiled for `args`: the teacher's weights an argument (as constants they would be compiled
    in), the parameters and optimizer state donated (their new values take their memory) and
    given back placed as they came, so that the program takes its own outputs; refused before it
    runs where it would not fit this GPU."""
    placed = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    outputs = (placed(args[0]), placed(args[1]), replicated, replicated)
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=outputs)
    compiled = jitted.lower(*args).compile()
    plan_devices.check_fits(
        Figures.of(compiled).peak,
        f"the {name} stage's train step",
        "pass model.remat=full if it is not (a layer then saves its input, not its products' "
        "outputs), a smaller --batch with more --steps, or give jax more of the GPU "
        f"(XLA_PYTHON_CLIENT_MEM_FRACTION, {plan_devices.JAX_MEMORY_FRACTION} by default)",
    )
    return compiled


def spent_seconds(loop: trainer.TrainLoop, done: int) -> float:
    """Training seconds of a stage's first `done` steps, which earlier runs made (on process 0,
    which writes the metrics; `trainer.agreed` makes its decisions every process's)."""
    return sum(step.get("seconds", 0.0) for step in trainer.read_metrics(loop.metrics_path)[:done])


def lm_loss(logits, batch):
    total, count = next_token_loss(logits, batch["tokens"], batch["segment_ids"])
    return total / jnp.maximum(count, 1)


def target_loss(model, _, batch):
    loss = lm_loss(model(batch["tokens"], batch["segment_ids"], batch["positions"]), batch)
    return loss, loss


def draft_loss_of(draft, target, batch, hidden, features, ttt_steps: int):
    """(loss, agreement) of the draft against the target's final-normed `hidden` states (its
    distribution) and `features` (the draft's kind) on one batch of rows; the target's side
    detached."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    shared = jax.tree.map(lambda w: w.astype(features.dtype), Shared.of(target))
    out = draft_loss(
        draft,
        shared,
        features,
        hidden,
        tokens,
        seg,
        pos,
        seg != 0,
        steps=ttt_steps,
        decay=0.8,
        temperature=1.0,
        chunk=512,
    )
    return out.loss, out.agreement


def draft_loss_fn(ttt_steps: int):
    """The co-training loss of the draft against the frozen target on one batch of rows."""

    def loss(draft, target, batch):
        tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
        hidden, features = target(tokens, seg, pos, features=draft.features, head=False)
        return draft_loss_of(draft, target, batch, hidden, features, ttt_steps)

    return loss


class TargetWithHead(nnx.Module):
    """The target and its MTP head, trained together (`--mtp-weight`)."""

    def __init__(self, target, head):
        self.target, self.head = target, head


def joint_loss_fn(weight: float, ttt_steps: int):
    """The target's loss plus `weight` times its MTP head's, from one forward of the trunk (the
    head learns on the trunk's features as they are, detached: it does not shape the trunk)."""

    def loss(module, _, batch):
        tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
        logits, final = module.target(tokens, seg, pos, features="final")
        lm = lm_loss(logits, batch)
        head, _ = draft_loss_of(module.head, module.target, batch, final[0], final, ttt_steps)
        return lm + weight * head, lm

    return loss


# ---------------------------------------------------------------------------------------------
# Evaluation and output.


def evaluate(target, draft, ttt_steps, batches, n: int, bytes_per_token: float) -> dict:
    """Held-out loss of the target and top-1 agreement of the draft's first step."""
    (t_def, t_state), (d_def, d_state) = nnx.split(target), nnx.split(draft)

    @jax.jit
    def f(t_state, d_state, batch):
        target, draft = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
        return target_loss(target, None, batch)[0], draft_loss_fn(ttt_steps)(draft, target, batch)

    out = [f(t_state, d_state, batches(i)) for i in range(n)]
    losses, agree = [float(t) for t, _ in out], [float(d[1]) for _, d in out]
    nats = float(np.mean(losses))
    return dict(
        heldout_nats_per_token=nats,
        heldout_bits_per_byte=nats / math.log(2) / bytes_per_token,
        draft_top1_agreement=float(np.mean(agree)),
        bytes_per_token=bytes_per_token,
    )


def save_target(path: pathlib.Path, target, tokenizer: pathlib.Path) -> None:
    """The target in the Hugging Face layout with its tokenizer (tokenizer.json, and
    tokenizer_config.json naming EOS), a checkpoint `train_rl` (rl.policy) and serving engines
    load whole."""
    hf.save(path, target)
    tokenizers.HFTokenizer(tokenizer, EOS).save(path)


def stages(args, cfg, mesh, run: pathlib.Path) -> tuple[Stage, Stage]:
    """The target's stage and the draft's (of the run directory `run`; `cfg` the model's)."""
    save = lambda path, module: save_target(path, module, run / "tokenizer.json")
    target = Stage(
        "target",
        args.steps,
        args.learning_rate,
        target_loss,
        "loss",
        ("steps", "learning_rate"),
        save,
        lambda path: hf.load(path, mesh),
    )
    if args.mtp_weight:  # the target with its head beside it, as the mtp stage ships them

        def save_joint(path: pathlib.Path, module: TargetWithHead) -> None:
            save(path, module.target)
            hf_mtp.save(path, module.head)

        load = lambda path: TargetWithHead(hf.load(path, mesh), hf_mtp.load(path, cfg, mesh))
        flags = ("steps", "learning_rate", "mtp_weight", "ttt_steps")
        loss = joint_loss_fn(args.mtp_weight, args.ttt_steps)
        target = dataclasses.replace(target, loss=loss, flags=flags, save=save_joint, load=load)
    draft_flags = ("draft_steps", "draft_minutes", "draft_learning_rate", "ttt_steps")
    train_draft = lambda name, save, load: Stage(
        name,
        args.draft_steps,
        args.draft_learning_rate,
        draft_loss_fn(args.ttt_steps),
        "agreement",
        draft_flags,
        save,
        load,
        args.draft_minutes,
    )
    if args.draft_kind == "mtp":

        def ship(path: pathlib.Path, head) -> None:  # the target, its head beside it
            shutil.copytree(run / target.name, path)
            hf_mtp.save(path, head)

        return target, train_draft("mtp", ship, lambda path: hf_mtp.load(path, cfg, mesh))
    if args.draft_kind.startswith("block"):
        save = lambda path, draft: hf_block.save(path, draft, cfg)
        load = lambda path: hf_block.load(path, cfg, mesh=mesh)
        return target, train_draft(args.draft_kind, save, load)
    return target, train_draft("draft", hf_eagle3.save, lambda path: hf_eagle3.load(path, mesh)[0])


def run_stage(run: pathlib.Path, stage: Stage, module, batches, mesh, loop, teacher=None):
    """`module` with the weights of the stage finished at `run`/<stage> (`stage.load`); else
    trained by `fit` (which resumes from `loop`'s newest checkpoint) and saved whole there by
    `stage.save` (through a temporary folder, so a partial save is never read), its checkpoints
    then deleted."""
    path = run / stage.name
    if path.is_dir():
        nnx.update(module, nnx.state(stage.load(path), nnx.Param))
        print(f"{stage.name}: the finished stage at {path}", flush=True)
        return module
    module = fit(stage, module, batches, mesh, loop, teacher)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    stage.save(partial, module)
    partial.rename(path)
    loop.remove_checkpoints()
    return module


def data_mesh(devices: int, batch: int):
    """The mesh whose data axis splits the batch over `devices` (0: every device)."""
    n = devices or jax.device_count()
    if not 1 <= n <= jax.device_count() or batch % n:
        raise ConfigError(
            f"--data-parallel={devices} gives {n} devices of the {jax.device_count()} present, "
            f"which must split --batch={batch} evenly; pass a device count that divides the batch."
        )
    return mesh_lib.make_mesh(MeshConfig(data=n), jax.devices()[:n])


def train_models(args, cfg, run: pathlib.Path, mesh, corpus: Corpus, loops, limits):
    """(target, draft), each trained in its stage through `loops[stage]` (or loaded, the stage
    finished)."""
    target_stage, draft_stage = loops
    batches = sampler(*corpus.train, args.seq_len, args.batch, seed=0, mesh=mesh)
    target = create(cfg, mesh=mesh)
    size = sum(x.size for x in jax.tree.leaves(nnx.state(target, nnx.Param)))
    print(f"target: {size:,} parameters", flush=True)
    head = create_mtp(MTPConfig.for_target(cfg), mesh=mesh) if draft_stage.name == "mtp" else None
    if args.mtp_weight:  # the head trained with the target, then on to the draft's stage
        joint = run_stage(
            run, target_stage, TargetWithHead(target, head), batches, mesh, loops[target_stage]
        )
        target, head = joint.target, joint.head
    else:
        target = run_stage(run, target_stage, target, batches, mesh, loops[target_stage])
    print(f"target trained {limits.stamp()}", flush=True)
    limits.check(before="the draft's stage")  # the target's last step ended past a limit
    if draft_stage.name == "mtp":
        draft = head
    elif draft_stage.name.startswith("block"):
        chained = draft_stage.name == "block-chained"
        draft = create_block(BlockConfig.for_target(cfg, chained=chained), mesh=mesh)
    else:
        draft = create_eagle3(Eagle3Config.for_target(cfg), mesh=mesh)
    draft = run_stage(run, draft_stage, draft, batches, mesh, loops[draft_stage], target)
    print(f"draft trained {limits.stamp()}", flush=True)
    return target, draft


def stage_record(run: pathlib.Path, stage: str) -> tuple[int, float | None]:
    """(steps, training seconds) of `stage` in `run`: the steps it made and their seconds summed
    over the runs that made them, each run's first step (its compile) left out (None where its
    metrics do not time the steps)."""
    steps = trainer.read_metrics(run / "training" / stage / "metrics.jsonl")
    if not any({"seconds", "compile_seconds"} & set(step) for step in steps):
        return len(steps), None
    return len(steps), sum(step.get("seconds", 0.0) for step in steps)


def earlier_drafts(path: pathlib.Path) -> dict:
    """The `drafts` of an earlier report.json in the run directory; one written before drafts
    were kept by kind tells of its own draft alone."""
    if not path.is_file():
        return {}
    report = json.loads(path.read_text())
    if "drafts" in report:
        return report["drafts"]
    kind = report["args"].get("draft_kind", "eagle3")
    return {
        kind: dict(
            draft_steps=report["args"]["draft_steps"],
            draft_seconds=None,
            draft_top1_agreement=report["draft_top1_agreement"],
        )
    }


def write_report(args, run: pathlib.Path, stage: str, target, draft, corpus: Corpus, mesh) -> None:
    """Held-out loss and agreement to report.json (and the terminal), the held-out files to
    heldout.json. Its `drafts` holds each draft kind trained on this target in `run` (one run
    directory may hold all three), with its steps, training seconds and agreement; the fields
    outside it are the latest run's."""
    heldout_batches = sampler(*corpus.heldout, args.seq_len, args.batch, seed=1, mesh=mesh)
    report = evaluate(
        target, draft, args.ttt_steps, heldout_batches, args.eval_batches, corpus.bytes_per_token
    )
    drafts = earlier_drafts(run / "report.json")
    steps, seconds = stage_record(run, stage)
    drafts[args.draft_kind] = dict(
        draft_steps=steps,
        draft_seconds=seconds,
        draft_top1_agreement=report["draft_top1_agreement"],
    )
    report.update(args=vars(args), config=args.config, eos_token=EOS, drafts=drafts)
    print(json.dumps(report, indent=2), flush=True)
    (run / "heldout.json").write_text(json.dumps(corpus.heldout_texts))
    (run / "report.json").write_text(json.dumps(report, indent=2))


def main(argv=None):
    args = parse_args(argv)
    limits = trainer.Limits.from_args(args)  # --stop-after counts from here
    cfg = config_lib.load(args.config, args.overrides).model
    if args.seq_len > cfg.max_seq_len:
        raise ConfigError(
            f"--seq-len={args.seq_len} is longer than the model's max_seq_len={cfg.max_seq_len}; "
            f"pass a shorter --seq-len or model.max_seq_len={args.seq_len}."
        )
    mesh = data_mesh(args.data_parallel, args.batch)
    run = cli.run_directory(pathlib.Path(args.run_dir))
    # {stage: its loop, None when finished}: the checkpoints' configs checked before anything
    unfinished = lambda stage: not (run / stage.name).is_dir()
    staged = stages(args, cfg, mesh, run)
    if not unfinished(staged[0]):  # the finished target a draft trains on: the flags' model
        hf.check_config(run / staged[0].name, cfg)
    loops = {s: stage_loop(run, args, cfg, s, limits) if unfinished(s) else None for s in staged}
    say = lambda msg: print(msg, flush=True)
    with trainer.resumable(say), contextlib.ExitStack() as closing:
        for loop in filter(None, loops.values()):
            closing.enter_context(loop)
        corpus = read_corpus(args, cfg.vocab_size, run, limits)
        target, draft = train_models(args, cfg, run, mesh, corpus, loops, limits)
    _, draft_stage = loops
    write_report(args, run, draft_stage.name, target, draft, corpus, mesh)


if __name__ == "__main__":
    sys.exit(cli.run(main))
