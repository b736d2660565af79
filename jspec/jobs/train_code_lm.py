"""A target language model and its EAGLE-3 draft, trained from scratch on Python source code, so
that speculative decoding's acceptance (and so its speedup) is measured on a real model.

No model hub is reachable from the GPU machines; the `.py` files of the Python installation
(standard library and site-packages: tens of MB of real code) are. The script
  1. splits the files into training and held-out files (by a hash of the path: stable),
  2. trains a byte-level BPE tokenizer on the training files (`tokenizers`),
  3. trains the target (`--config`, 1.4B parameters for `code-1b`) by next-token cross-entropy on
     packed rows of whole files (attention never crosses a file boundary),
  4. trains an EAGLE-3 draft on the frozen target's taps and distribution with the co-training
     loss of `jspec.rl.draft_loss` (the training-time test),
  5. reports held-out loss (nats per token, bits per byte) and the draft's top-1 agreement, and
     writes tokenizer, target and draft (Hugging Face and public EAGLE-3 layouts) to `--run-dir`.
Both stages split the batch over every device (`--data-parallel`; parameters replicated). Each
stage checkpoints every `--save-minutes`: a run that dies resumes from the newest checkpoint
of the stage it was in (a finished stage is loaded, not trained again). Under a time limit (a
job's, a lent machine's), `--stop-after MINUTES` saves the stage's step at that time and exits with
status 75; the same command resumes.
`python -m jspec.bench.rollout --trained RUN_DIR` then measures plain and speculative
decoding on prompts from the held-out files.

    python -m jspec.jobs.train_code_lm --run-dir runs/code-1b             # on a GPU
    python -m jspec.jobs.train_code_lm --config tiny model.vocab_size=512 --steps 4 \
        --draft-steps 2 --batch 2 --seq-len 128 --max-bytes 2000000 --run-dir /tmp/code  # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import sysconfig
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec.config import ConfigError, MeshConfig
from jspec.jobs import cli
from jspec.models import create, hf, hf_eagle3
from jspec.models.draft import Eagle3Config, create_eagle3
from jspec.rl.draft_loss import draft_loss

EOS = "<eos>"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="code-1b")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--roots", nargs="*", help="folders of .py files (default: the stdlib and "
                   "site-packages of this Python)")  # fmt: skip
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="corpus size cap")
    p.add_argument("--heldout", type=int, default=20, help="one file in N is held out")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--data-parallel",
        type=int,
        default=0,
        help="devices the batch is split over (0: every device); --batch must be a multiple",
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--learning-rate", type=float, default=6e-4)
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--draft-learning-rate", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument(
        "--save-minutes",
        type=float,
        default=4.0,
        help="minutes between checkpoints of a stage in training (a run that dies resumes from "
        "the newest; a save of the 1.4B target and its optimizer state writes about 17 GB)",
    )
    p.add_argument(
        "--stop-after",
        type=float,
        metavar="MINUTES",
        help="a time limit: once this many minutes have passed, the stage in training saves its "
        f"step and the run exits with status {EXIT_RESUME}; the same command resumes it",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The corpus.


def python_files(roots: list[str] | None, max_bytes: int) -> list[tuple[str, str]]:
    """(path, text) of the .py files under `roots`, in path order, up to `max_bytes` in all."""
    if not roots:
        paths = sysconfig.get_paths()
        roots = sorted({paths["stdlib"], paths["purelib"]})
    files, total = [], 0
    for root in roots:
        for path in sorted(pathlib.Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip() and total < max_bytes:
                files.append((str(path), text))
                total += len(text)
    if not files:
        raise ConfigError(f"no .py files under {roots}; pass --roots with folders of Python code.")
    return files


def split(files, heldout: int) -> tuple[list[str], list[str]]:
    """Training and held-out texts: a file is held out when the hash of its path says so."""
    out = ([], [])
    for path, text in files:
        out[zlib.crc32(path.encode()) % heldout == 0].append(text)
    if not all(out):
        raise ConfigError(
            f"{len(files)} files give {len(out[0])} training and {len(out[1])} held-out files "
            f"(one in --heldout={heldout}); raise --max-bytes or name more --roots."
        )
    return out


def train_tokenizer(texts: list[str], vocab_size: int, path: pathlib.Path):
    """A byte-level BPE tokenizer of `vocab_size` ids (the last is `EOS`), saved to `path`; the
    one already at `path` if an earlier run wrote it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([EOS])
    if tok.get_vocab_size() != vocab_size:
        raise ConfigError(
            f"the corpus gives a tokenizer of {tok.get_vocab_size()} ids, not model.vocab_size="
            f"{vocab_size}; use a larger corpus or a smaller vocabulary."
        )
    tok.save(str(path))
    return tok


def token_stream(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All texts as one stream of ids, each file ended by EOS, and the file index of each id."""
    eos = tok.token_to_id(EOS)
    ids = [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
    doc = np.concatenate([np.full(len(x), i, np.int32) for i, x in enumerate(ids)])
    return np.concatenate([np.asarray(x, np.int32) for x in ids]), doc


def rows(stream, doc, starts: np.ndarray, t: int, mesh) -> dict[str, jax.Array]:
    """Packed rows of t ids from `starts`, split over `mesh`'s data axis: segment ids number the
    files of a row from 1, positions restart at each file's first id in the row."""
    idx = starts[:, None] + np.arange(t)
    d = doc[idx]
    seg = d - d[:, :1] + 1
    first = np.maximum.accumulate(np.where(np.diff(d, prepend=-1, axis=1) != 0, np.arange(t), 0),
                                  axis=1)  # fmt: skip
    batch = dict(tokens=stream[idx], segment_ids=seg, positions=np.arange(t) - first)
    placed = mesh_lib.sharding(mesh, ("batch", None))
    return {k: jax.device_put(v.astype(np.int32), placed) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Training.


def next_token_loss(logits, tokens, segment_ids) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy of each token's successor within its file, and the count."""
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    return jnp.sum(jnp.where(same, nll, 0.0)), jnp.sum(same)


def adamw(learning_rate: float, steps: int):
    warmup = max(steps // 20, 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1)
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


EXIT_RESUME = 75  # the exit status of a run stopped by --stop-after (EX_TEMPFAIL: run it again)


class OutOfTime(Exception):
    """A stage stopped at the run's time limit, its newest step saved."""


class StepSaves:
    """Checkpoints of a stage in training (parameters, optimizer state, steps done) in
    `directory`, one every `minutes` and one at the `deadline` (a `time.perf_counter()`; None:
    none), the newest kept: batch i is the same in every run, so a run resumed after step n
    continues as the run that died would have."""

    def __init__(self, directory: pathlib.Path, minutes: float, deadline: float | None = None):
        self.directory, self.seconds, self.deadline = directory.resolve(), 60 * minutes, deadline
        options = ocp.CheckpointManagerOptions(max_to_keep=1)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.last = time.perf_counter()

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.seconds or self.out_of_time()

    def out_of_time(self) -> bool:
        return past(self.deadline)

    def save(self, step: int, params, opt_state) -> None:
        state = dict(params=params, opt_state=opt_state)
        self.manager.save(step, args=ocp.args.StandardSave(state))
        self.last = time.perf_counter()

    def restore(self, params, opt_state):
        """(params, opt_state, steps done) of the newest checkpoint, placed like the arguments;
        None when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        template = dict(params=params, opt_state=opt_state)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return state["params"], state["opt_state"], step

    def remove(self) -> None:
        """Drops the checkpoints once the stage is saved whole."""
        self.manager.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def past(deadline: float | None) -> bool:
    """Whether `deadline` (a `time.perf_counter()`; None: none) has passed."""
    return deadline is not None and time.perf_counter() >= deadline


def fit(module, loss_fn, batches, steps: int, learning_rate: float, name: str, mesh,
        teacher=None, saves: StepSaves | None = None):  # fmt: skip
    """Trains the Params of `module` on `loss_fn(module, teacher, batch) -> (loss, metric)` over
    the data-parallel `mesh`, the teacher (a module, or None) frozen, from the newest of `saves` if
    any; returns the trained module."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    teacher_def, teacher_state = nnx.split(teacher)
    opt = adamw(learning_rate, steps)

    @jax.jit  # the teacher's weights are an argument: as constants they would be compiled in
    def step(params, opt_state, teacher_state, batch):
        teacher = nnx.merge(teacher_def, teacher_state)
        f = lambda p: loss_fn(nnx.merge(graphdef, p, rest), teacher, batch)
        (loss, metric), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metric

    # replicated, as the parameters are on the data-parallel mesh (the step count too, else born
    # on one device, and so restored there)
    opt_state = jax.device_put(opt.init(params), NamedSharding(mesh, PartitionSpec()))
    done, start = 0, time.perf_counter()
    if saves is not None and (restored := saves.restore(params, opt_state)) is not None:
        params, opt_state, done = restored
        print(f"{name}: resumed after step {done} from {saves.directory}", flush=True)
    for i in range(done, steps):
        params, opt_state, loss, metric = step(params, opt_state, teacher_state, batches(i))
        if i % max(steps // 20, 1) == 0 or i == steps - 1:
            print(f"{name} step {i:5d}  loss {float(loss):.4f}  {float(metric):.4f}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)  # fmt: skip
        if saves is not None and i + 1 < steps and saves.due():
            saves.save(i + 1, params, opt_state)
            if saves.out_of_time():  # the process exits next: the (background) save first
                saves.manager.wait_until_finished()
                raise OutOfTime(f"{name}: stopped at the time limit after step {i + 1}, saved in "
                                f"{saves.directory}")  # fmt: skip
    return nnx.merge(graphdef, params, rest)


def target_loss(model, _, batch):
    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    total, count = next_token_loss(logits, batch["tokens"], batch["segment_ids"])
    loss = total / jnp.maximum(count, 1)
    return loss, loss


def draft_loss_fn(ttt_steps: int):
    """The co-training loss of the draft against the frozen target on one batch of rows."""

    def loss(draft, target, batch):
        tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
        logits, taps = target(tokens, seg, pos, taps=True)
        embed = target.embed[...].astype(taps.dtype)
        out = draft_loss(
            draft, embed, taps, logits, tokens, seg, pos, seg != 0,
            steps=ttt_steps, decay=0.8, temperature=1.0, chunk=512,
        )  # fmt: skip
        return out.loss, out.agreement

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


def stage(path: pathlib.Path, module, train, save, load, minutes: float, deadline):
    """`module` with the weights of a finished stage at `path` (`load(path)`: a module); else
    `train(saves)`, which checkpoints every `minutes` and at the `deadline` in `path`.steps (a run
    that died or stopped resumes from the newest), saved whole to `path` by `save` (through a
    temporary folder, so a partial save is never read)."""
    if path.is_dir():
        nnx.update(module, nnx.state(load(path), nnx.Param))
        print(f"{path.name}: the finished stage at {path}", flush=True)
        return module
    saves = StepSaves(path.with_name(path.name + ".steps"), minutes, deadline)
    module = train(saves)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save(partial, module)
    partial.rename(path)
    saves.remove()
    return module


def sampler(stream, doc, t: int, batch: int, seed: int, mesh):
    """batches(i): `batch` rows of t ids from random starts, the same for the same i."""
    high = len(stream) - t
    if high <= 0:
        raise ConfigError(f"the corpus holds {len(stream)} tokens, fewer than --seq-len={t}.")
    starts = lambda i: np.random.default_rng([seed, i]).integers(0, high, batch)
    return lambda i: rows(stream, doc, starts(i), t, mesh)


def data_mesh(devices: int, batch: int):
    """The mesh whose data axis splits the batch over `devices` (0: every device)."""
    n = devices or jax.device_count()
    if not 1 <= n <= jax.device_count() or batch % n:
        raise ConfigError(
            f"--data-parallel={devices} gives {n} devices of the {jax.device_count()} present, "
            f"which must split --batch={batch} evenly; pass a device count that divides the batch."
        )
    return mesh_lib.make_mesh(MeshConfig(data=n), jax.devices()[:n])


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    at = lambda: f"[{time.perf_counter() - start:.0f} s into the run]"
    deadline = None if args.stop_after is None else start + 60 * args.stop_after
    cfg = config_lib.load(args.config, args.overrides).model
    mesh = data_mesh(args.data_parallel, args.batch)
    run = cli.run_directory(pathlib.Path(args.run_dir))
    train_texts, heldout_texts = split(python_files(args.roots, args.max_bytes), args.heldout)
    tok = train_tokenizer(train_texts, cfg.vocab_size, run / "tokenizer.json")
    train, heldout = token_stream(tok, train_texts), token_stream(tok, heldout_texts)
    bytes_per_token = sum(map(len, map(str.encode, heldout_texts))) / len(heldout[0])
    print(f"corpus: {len(train_texts)} training files ({len(train[0]):,} tokens), "
          f"{len(heldout_texts)} held out ({len(heldout[0]):,} tokens, "
          f"{bytes_per_token:.2f} bytes a token) {at()}", flush=True)  # fmt: skip
    batches = sampler(*train, args.seq_len, args.batch, seed=0, mesh=mesh)
    target = create(cfg, mesh=mesh)
    print(f"target: {sum(x.size for x in jax.tree.leaves(nnx.state(target, nnx.Param))):,} "
          "parameters", flush=True)  # fmt: skip
    try:
        target_trains = not (run / "target").is_dir()
        target = stage(
            run / "target", target,
            lambda saves: fit(target, target_loss, batches, args.steps, args.learning_rate,
                              "target", mesh, saves=saves),
            hf.save, lambda path: hf.load(path, mesh), args.save_minutes, deadline,
        )  # fmt: skip
        print(f"target trained {at()}", flush=True)
        if target_trains and past(deadline):  # its last step ended past the limit
            raise OutOfTime("the time limit came before the draft's stage")
        draft = create_eagle3(Eagle3Config.for_target(cfg), mesh=mesh)
        draft = stage(
            run / "draft", draft,
            lambda saves: fit(draft, draft_loss_fn(args.ttt_steps), batches, args.draft_steps,
                              args.draft_learning_rate, "draft", mesh, teacher=target,
                              saves=saves),
            hf_eagle3.save, lambda path: hf_eagle3.load(path, mesh)[0], args.save_minutes,
            deadline,
        )  # fmt: skip
    except OutOfTime as stop:
        print(f"{stop} {at()}; run the same command to resume", flush=True)
        raise SystemExit(EXIT_RESUME) from None
    print(f"draft trained {at()}", flush=True)
    heldout_batches = sampler(*heldout, args.seq_len, args.batch, seed=1, mesh=mesh)
    report = evaluate(target, draft, args.ttt_steps, heldout_batches, args.eval_batches,
                      bytes_per_token)  # fmt: skip
    report.update(args=vars(args), config=args.config, eos_token=EOS)
    print(json.dumps(report, indent=2), flush=True)
    (run / "heldout.json").write_text(json.dumps(heldout_texts))
    (run / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(cli.run(main))
