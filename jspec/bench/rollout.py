"""Rollout speed: plain decoding through `jspec.sampler.generate`, and the cost of verifying a draft
tree against one decode step, per batch size, and the cost of a whole speculative step.

    python -m jspec.bench.rollout --config qwen3-8b --batches 1 16 64  # on a GPU
    python -m jspec.bench.rollout --device cpu --config tiny --batches 2 \
        --prompt-len 64 --new-tokens 16                                       # a smoke test

For each batch: prompts of `--prompt-len` tokens are prefilled; `generate` runs `--new-tokens`
greedy tokens with no draft (its verify step holds only the root, so a step is one decode) over a
queue of `--prompts-per-row` prompts a row; the decode step time is (time of M tokens - time of 1
token) / their difference in loop steps, which removes the prefills. The cost curve runs the
target's verify of a chain of N nodes against the same cache (as `generate` runs it: written into
the cache, read there, forgotten) in a jitted loop, reported in plain decode steps (a verify of N =
1 is the target's part of one). The memory floor of a decode step is (weights + KV cache read) /
the copy rate (`--bandwidth`, by default measured on the device: 4.1 TB/s on an H200, 3.0 on an
H100). A speculative step (an EAGLE-3 draft proposing each of `--trees`, verify, cache updates) is
timed the same way and reported in decode steps: the accepted length at which it breaks even.
Weights are random (speed only, not acceptance) unless `--trained RUN_DIR` names the target and
draft written by `jspec.jobs.train_code_lm`: then prompts are held-out source files, and each
speculative step comes with its accepted length, the measured speedup over plain decoding (tokens/s
of `generate`, over `--acceptance-rows` distinct prompts: a small batch runs several batches of
them) and the speedup predicted from the verify cost curve, the draft's proposal and the loop's
own work (plain decoding's step less its forward). Prints a table and writes JSON; every speedup
is quoted with its temperature, its tree's kind (sampled or argmax) and where the draft came from
(random, or trained offline: its steps and held-out agreement). The default trees follow
`--temperature`: trees drawn from the draft above 0 (what RL samples at), argmax trees at 0.

`--profile DIR` adds tables of the GPU kernels of one step of the plain, speculative and verify
loops (two loop lengths traced, their difference kept, so the prefill drops out); run under
`XLA_FLAGS="--xla_dump_to=D --xla_dump_hlo_module_re=.*(generate|run).*"` and each fusion in them
is named by its output shape and JAX op.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import config as config_lib
from jspec.attention.decode import cache_slots
from jspec.bench import trained_run
from jspec.bench.greedy_check import check_greedy
from jspec.bench.kernel_profile import loop_kernels
from jspec.bench.timing import best_time, copy_bandwidth, log, loop_seconds
from jspec.config import KernelConfig, RolloutConfig, TreeConfig
from jspec.jobs import cli
from jspec.models import create
from jspec.models.draft import Eagle3Config, Shared, create_eagle3
from jspec.sampler import compile_generate, generate, tree_proposal
from jspec.sampler.tree_choice import StepCosts, choose_tree


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    count = cli.at_least(1)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="qwen3-8b")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--batches", type=count, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=count, default=512)
    p.add_argument("--new-tokens", type=count, default=64)
    p.add_argument("--tree-sizes", type=count, nargs="*", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--no-spec", action="store_true", help="skip the speculative steps")
    p.add_argument(
        "--trees",
        nargs="+",
        choices=list(TREES),
        default=None,
        metavar="NAME",
        help=f"the draft trees timed, of {', '.join(map(repr, TREES))}; default: "
        f"{DEFAULT_TREES[True]} above T=0, {DEFAULT_TREES[False]} at 0",
    )
    p.add_argument(
        "--draft-vocab", type=count, default=32000, help="the random EAGLE-3 draft's vocabulary"
    )
    p.add_argument(
        "--compare",
        nargs="*",
        choices=sorted(COMPARED),
        default=[],
        help="also time the plain step with other rollout attention: 'blocks' (the block kernels "
        "in place of impl='decode'; they transpose the heads-major cache, a copy per layer), "
        "'xla' (the cache part in XLA, not the Pallas kernel), 'xla-qkv' (the q/k norms, rotary "
        "and cache writes after the q/k/v product as XLA's fusions, not `qkv_epilogue`)",
    )
    p.add_argument(
        "--prompts-per-row",
        type=count,
        default=4,
        help="prompts the loops of generate run per row (continuous batching: a row that finishes "
        "takes the next prompt), so that rows done early do not idle until the batch is done",
    )
    p.add_argument(
        "--acceptance-rows",
        type=count,
        default=16,
        help="at least this many prompts at every batch size (batch 1 runs them one after "
        "another), so that batch 1 does not measure one prompt's acceptance",
    )
    p.add_argument(
        "--compile-threads",
        type=count,
        default=4,
        help="programs compiled at once before a batch is timed (compiled, not run: the memory "
        "of the host's compiler threads is the limit)",
    )
    p.add_argument("--iters", type=count, default=3, help="timed repeats (the best is kept)")
    p.add_argument("--bandwidth", type=cli.positive, help="device copy bytes/s (default: measured)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="trace the plain and speculative loops and the smallest and largest verify; print "
        "their top kernels",
    )
    add_model_arguments(p)
    cli.add_compilation_cache_argument(p)  # kinds of draft timed one after another share programs
    p.add_argument("--out", default="bench_rollout.json")
    args = p.parse_args(argv)
    args.trees = args.trees or list(DEFAULT_TREES[args.temperature > 0])
    return args


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of what is decoded: the trained models (else random weights), the
    temperature, and the greedy check of the rollout path against the models' own decoding."""
    p.add_argument(
        "--trained",
        metavar="RUN_DIR",
        help="target, draft and held-out prompts written by jspec.jobs.train_code_lm",
    )
    p.add_argument(
        "--draft-kind",
        choices=tuple(trained_run.DRAFT_DIRS),
        default=None,
        help="with --trained: which of the run's drafts (default: its latest run's kind)",
    )
    p.add_argument("--temperature", type=cli.at_least(0, float), default=0.0)
    p.add_argument(
        "--check-greedy",
        action="store_true",
        help="first check, in float32, that greedy tokens of the rollout path (plain, and each "
        "tree of --trees even with --no-spec) equal a step-by-step loop of the model's own prefill "
        "and decode; with --trained, of the trained target and draft",
    )


# Trees of the speculative steps timed: a step's cost in decode steps is the accepted length at
# which speculation breaks even. Names without "sampled" are argmax trees (the draft's top-ranked
# tokens, verified as point masses); "sampled" ones are drawn from the draft (at temperature 0
# they too take its top-ranked tokens). "+ 2 siblings": the draft's second choice beside the
# chain's first two nodes, as leaves (a second chance where a miss is likeliest, for no more draft
# forwards); "+ 4 siblings": its second and third beside the first, its second beside the second
# and third. "sampled dynamic 8": a sampled chain of 5 and 3 siblings where the draft is least
# sure, the 8 nodes SGLang's EAGLE-2 default verifies; "sampled dynamic 16": a chain of 6 and 10
# siblings, for small batches, where a verify of 16 nodes costs little more than one of 1.
CHAIN_4_2 = (-1, -1, 0, 0, 2, 4)
TREES = {  # the trees `--trees` may name
    "chain 4": TreeConfig(kind="chain", depth=4, sampled=False),
    "chain 6": TreeConfig(kind="chain", depth=6, sampled=False),
    "sampled chain 4": TreeConfig(kind="chain", depth=4, sampled=True),
    "sampled chain 6": TreeConfig(kind="chain", depth=6, sampled=True),
    "chain 4 + 2 siblings": TreeConfig(kind="static", parents=CHAIN_4_2, sampled=False),
    "sampled chain 4 + 2 siblings": TreeConfig(kind="static", parents=CHAIN_4_2, sampled=True),
    "chain 6 + 2 siblings": TreeConfig(
        kind="static", parents=(-1, -1, 0, 0, 2, 4, 5, 6), sampled=False
    ),
    "chain 6 + 4 siblings": TreeConfig(
        kind="static", parents=(-1, -1, -1, 0, 0, 3, 3, 5, 7, 8), sampled=False
    ),
    "dynamic 8 (SGLang)": TreeConfig(
        kind="dynamic", depth=5, top_k=4, total_tokens=8, sampled=False
    ),
    "dynamic 16": TreeConfig(kind="dynamic", depth=6, top_k=4, total_tokens=16, sampled=False),
    "sampled dynamic 8": TreeConfig(kind="dynamic", depth=5, top_k=4, total_tokens=8),
    "sampled dynamic 16": TreeConfig(kind="dynamic", depth=6, top_k=4, total_tokens=16),
}
# The trees timed by default, by whether the temperature is above 0: RL samples at 1, where
# argmax trees are accepted far less than trees drawn from the draft.
DEFAULT_TREES = {
    True: ("sampled chain 4", "sampled dynamic 8"),
    False: ("chain 4", "dynamic 8 (SGLang)"),
}


def timed_trees(args) -> dict[str, TreeConfig]:
    """The trees this run times: `--trees`, none with `--no-spec`."""
    return {} if args.no_spec else {name: TREES[name] for name in args.trees}


# Bodies of the verify and draft loops timed (their difference is kept): their programs prefill
# first, which both lengths pay, so the difference must be long enough that the prefill's jitter
# (a share of a second at batch 256) stays small beside it.
LOOP_LENGTHS = dict(short=2, long=34)

# Other rollout attention the plain step can be timed with (`--compare`).
COMPARED = {
    "blocks": KernelConfig(few_queries=0),
    "xla": KernelConfig(decode_backend="xla"),
    "xla-qkv": KernelConfig(qkv_kernel=False),
}


class LoopRate(NamedTuple):
    """The `generate` loop over a queue of prompts, its prefills left out."""

    step: float  # seconds a step of the loop takes
    tokens_per_s: float  # tokens the rows emit per second
    accepted: float  # tokens a row emits per verify step
    busy: float  # share of row-steps that emit (rows idle once the queue is empty)


def rollout_config(
    tree: TreeConfig, m: int, rows: int, args, kernels: KernelConfig | None = None
) -> RolloutConfig:
    """The rollout of a timed loop; `kernels` None: the default `KernelConfig()`."""
    kernels = kernels or KernelConfig()
    return RolloutConfig(
        max_new_tokens=m, temperature=args.temperature, tree=tree, rows=rows, kernels=kernels
    )


def loop_rate(model, draft, tree, prompts, rows: int, args, kernels=None) -> LoopRate:
    """`LoopRate` of `generate` (draft, verify, bookkeeping, refills; plain decoding when `draft`
    is None) over `prompts`, `rows` at a time, on `kernels` (`rollout_config`). A run of
    `--new-tokens` and one of one token prefill the same prompts in the same refills, so their
    time difference over their difference in loop steps is the time of a step."""
    lengths = jnp.full((prompts.shape[0],), args.prompt_len, jnp.int32)
    config = lambda m: rollout_config(tree, m, rows, args, kernels)
    stats = {}  # of each length's runs (all alike: same prompts, same key)

    def run(m):
        def call():
            out = generate(model, draft, prompts, lengths, jax.random.key(0), config(m))
            stats[m] = out.stats
            return out

        return call

    seconds = best_time(run(args.new_tokens), args.iters) - best_time(run(1), args.iters)
    long, short = stats[args.new_tokens], stats[1]
    step = seconds / (int(long.iterations) - int(short.iterations))
    return LoopRate(
        step=step,
        tokens_per_s=long.tokens_per_row_step() * rows / step,
        accepted=long.mean_accepted_length(),
        busy=long.busy(),
    )


def warm_up(model, draft, prompts, rows: int, loops: list, args) -> None:
    """Compiles, without running them, every program a batch times: the `generate` loops of plain
    decoding and of each tree, at `--new-tokens` and at one token, and the jitted `loops`
    (partials of a jitted function, all but the count bound), up to `--compile-threads` at a time:
    compiling is most of a run's time, and XLA compiles a program on about one core. (The
    backends of `--compare` are compiled where they are timed.)"""
    key, lengths = jax.random.key(0), jnp.full((prompts.shape[0],), args.prompt_len, jnp.int32)
    config = lambda tree, m: rollout_config(tree, m, rows, args)
    runs = [(None, TreeConfig()), *((draft, t) for t in timed_trees(args).values())]
    jobs = [
        functools.partial(compile_generate, model, d, prompts, lengths, key, config(tree, m))
        for d, tree in runs
        for m in (args.new_tokens, 1)
    ]
    jobs += [lambda r=run: r.func.lower(*r.args, jnp.int32(2)).compile() for run in loops]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        list(pool.map(lambda job: job(), jobs))
    log(f"batch {rows}: {len(jobs)} programs compiled in {time.perf_counter() - start:.0f} s")


def tree_nodes(tree: TreeConfig) -> int:
    """Nodes a verify step runs: the root and the tree's nodes."""
    if tree.kind == "dynamic":
        return 1 + tree.total_tokens
    return 1 + (tree.depth if tree.kind == "chain" else len(tree.parents))


def speculative(model, draft, prompts, rows, plain: LoopRate, curve, drafts: dict, args) -> dict:
    """Per tree of `drafts` (its `draft_loop`): the step's cost in plain decode steps, the accepted
    length, the measured speedup in tokens/s over plain decoding and the one the costs predict
    (`predicted_speedup`)."""
    out = {}
    for name, run in drafts.items():
        tree = TREES[name]
        spec = loop_rate(model, draft, tree, prompts, rows, args)
        drafting = loop_seconds(run, args.iters, **LOOP_LENGTHS)
        out[name] = dict(
            tree="sampled" if tree.sampled_at(args.temperature) else "argmax",
            step_in_decode_steps=spec.step / plain.step,
            draft_in_decode_steps=drafting / plain.step,
            accepted_length=spec.accepted,
            busy=spec.busy,
            speedup=spec.tokens_per_s / plain.tokens_per_s,
            predicted_speedup=predicted_speedup(
                spec, plain, curve[tree_nodes(tree)] + drafting, curve[1]
            ),
        )
        x = out[name]
        log(
            f"batch {rows}: {name}: step {x['step_in_decode_steps']:.2f} plain steps (draft "
            f"{x['draft_in_decode_steps']:.2f}), accepted {x['accepted_length']:.2f}, busy "
            f"{x['busy']:.2f}, speedup {x['speedup']:.2f}x (predicted "
            f"{x['predicted_speedup']:.2f}x)"
        )
    return out


def predicted_speedup(spec: LoopRate, plain: LoopRate, proposal_and_verify, forward) -> float:
    """The speedup the costs predict: tokens per row-step (accepted length x busy) over the step,
    against plain decoding's. The speculative step is the draft's proposal and the verify forward
    (`proposal_and_verify`, from their own loops) plus the loop's own work (sampling, writes, the
    loop's control), which both loops pay: plain decoding's step less its bare `forward`."""
    step = proposal_and_verify + plain.step - forward
    return (spec.accepted * spec.busy / step) / (plain.busy / plain.step)


def verify_loops(model, prompts, lengths, sizes, slots: int) -> dict:
    """For each n of `sizes`, the `verify_loop` of a chain of n nodes against the prompts' cache
    of `slots` slots per row (as many as `generate` allocates)."""
    graphdef, state = nnx.split(model)
    return {n: verify_loop(graphdef, state, prompts, lengths, n, slots) for n in sizes}


def verify_loop(graphdef, state, prompts, lengths, n: int, slots: int):
    """`run(count)`: the prompts prefilled, then `count` verify forwards of a chain of n nodes as
    `generate` runs them (`Transformer.extend`: written into the cache, read there, forgotten
    after), in a jitted loop (weights sliced once before it, as `generate` does): a partial of
    the jitted program. The prefill is in the program, so that it compiles with the others
    (`warm_up`); `loop_seconds` takes it out of the time."""
    b = prompts.shape[0]

    @jax.jit
    def run(state, count):
        model = nnx.merge(graphdef, state)
        cache = model.prefill(prompts, model.init_cache(b, slots), lengths)[1]
        model, written = model.for_rollout(), jnp.full((b,), n, jnp.int32)

        def body(i, carry):
            acc, cache = carry
            tokens = (prompts[:, :n] + i) % model.config.vocab_size
            logits, grown = model.extend(tokens, cache, written)
            return acc + logits[:, -1, 0], grown.forget(cache.length)

        start = (jnp.zeros((b,), jnp.float32), cache)
        return jax.lax.fori_loop(0, count, body, start)[0]

    return functools.partial(run, state)


def draft_loop(model, draft, prompts, lengths, tree: TreeConfig, slots: int, args):
    """`run(count)`: `count` proposals of `tree` by the draft from one prefilled root, in a jitted
    loop, as `generate` drafts (the root's token and logits move with the loop, so nothing is
    hoisted): a partial of the jitted loop."""
    b = prompts.shape[0]
    config = rollout_config(tree, args.new_tokens, b, args)

    @jax.jit
    def run(model, draft, count):
        target, draft = model.for_rollout(), draft.for_rollout()
        shared = Shared.of(target)  # in the compute dtype (`for_rollout`)
        cache = target.init_cache(b, slots)
        out = target.prefill(prompts, cache, lengths, features=draft.features)
        features = out[2] if draft.features else None
        root_token, draft_cache = jnp.argmax(out[0], -1), draft.init_cache(b, slots)
        root = draft.prefill(shared, prompts, lengths, root_token, features, draft_cache)

        def body(i, acc):
            moved = root._replace(logits=root.logits + 0.0 * acc[:, None])
            token = root_token + (0.0 * acc).astype(jnp.int32)
            key = jax.random.key(i)
            drafted = tree_proposal.draft_tree(draft, shared, moved, token, key, config)
            return acc + drafted.tokens[:, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, count, body, jnp.zeros((b,), jnp.float32))

    return functools.partial(run, model, draft)


def generate_kernels(model, draft, tree, prompts, name: str, args, kernels=None) -> list:
    """`loop_kernels` of a step of the `generate` loop (plain decoding when `draft` is None), on
    `kernels` (`rollout_config`)."""
    lengths = jnp.full((prompts.shape[0],), args.prompt_len, jnp.int32)
    config = lambda m: rollout_config(tree, m, prompts.shape[0], args, kernels)
    run = lambda m: generate(model, draft, prompts, lengths, jax.random.key(0), config(m))
    steps = int(run(args.new_tokens).stats.iterations)
    log_dir = f"{args.profile}/batch{prompts.shape[0]}-{name}"
    return loop_kernels(run, log_dir, (args.new_tokens, 1), steps)


def profile_kernels(model, draft, prompts, loops: dict, drafts: dict, args) -> dict:
    """Kernel tables of one step of the plain `generate` loop, of each tree's speculative loop,
    and of the smallest and largest verify of the cost curve."""
    kernels = {"plain": generate_kernels(model, None, TreeConfig(), prompts, "plain", args)}
    for name in drafts:
        tag = name.split(" (")[0].replace(" ", "")  # chain4, dynamic8
        kernels[name] = generate_kernels(model, draft, TREES[name], prompts, tag, args)
    for n in sorted({min(loops), max(loops)}):  # what verifying more nodes adds, kernel by kernel
        log_dir = f"{args.profile}/batch{prompts.shape[0]}-verify{n}"
        run = lambda c, n=n: loops[n](jnp.int32(c))
        kernels[f"verify {n}"] = loop_kernels(run, log_dir, (10, 2), 8)
    return kernels


def compare_backends(model, prompts, rows: int, args) -> tuple[dict, dict]:
    """The plain step (ms) over `prompts` and, with `--profile`, its kernel table, on each rollout
    attention of `--compare` (`COMPARED`: each compiles its own programs of `generate`)."""
    ms, tables = {}, {}
    for name in args.compare:
        kernels = COMPARED[name]
        ms[name] = 1e3 * loop_rate(model, None, TreeConfig(), prompts, rows, args, kernels).step
        if args.profile:
            tables[f"plain ({name})"] = generate_kernels(
                model, None, TreeConfig(), prompts[:rows], f"plain-{name}", args, kernels
            )
    return ms, tables


def decode_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: the rollout copy's (`Transformer.for_rollout`: in the
    compute dtype, input norms folded into the products) layers, final norm and head; the input
    embedding left out unless it is the head (a step gathers a row of it)."""
    rollout = nnx.eval_shape(lambda m: m.for_rollout(), model)
    head = rollout.embed if model.config.tie_embeddings else rollout.unembed
    read = nnx.state(nnx.List([*rollout.unstacked, rollout.final_norm, head]))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(read))


def memory_floor(cfg, batch: int, weight_bytes: int, args) -> float:
    """Seconds of a decode step that reads the weights and the mean cache once at `--bandwidth`."""
    tokens = batch * (args.prompt_len + args.new_tokens // 2)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return (weight_bytes + tokens * per_token) / args.bandwidth


def measure(model, draft, queue, batch: int, weight_bytes: int, args) -> dict:
    """One row of the table: the plain step, the verify cost curve, the speculative steps; the
    loops of `generate` run `batch` rows over the `queue` of prompts (plain decoding alone: over
    the first `batch`), the rest over the first `batch` prompts."""
    cfg, prompts = model.config, queue[:batch]
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)
    trees = timed_trees(args)
    sizes = {1, *args.tree_sizes, *map(tree_nodes, trees.values())}
    slots = cache_slots(args.prompt_len + max(args.new_tokens, *sizes), cfg.max_seq_len)
    loops = verify_loops(model, prompts, lengths, sorted(sizes), slots)
    drafts = {
        k: draft_loop(model, draft, prompts, lengths, t, slots, args) for k, t in trees.items()
    }
    # Plain decoding over the prompts speculation runs (rows that end early matter to both).
    queue = queue if trees else prompts
    warm_up(model, draft, queue, batch, [*loops.values(), *drafts.values()], args)
    plain = loop_rate(model, None, TreeConfig(), queue, batch, args)
    step = plain.step
    log(f"batch {batch}: plain step {1e3 * step:.2f} ms, busy {plain.busy:.2f}")
    curve = {n: loop_seconds(run, args.iters, **LOOP_LENGTHS) for n, run in loops.items()}
    log(
        f"batch {batch}: verify costs "
        + ", ".join(f"{n}: {s / step:.2f}" for n, s in curve.items())
        + " plain steps"
    )
    floor = memory_floor(cfg, batch, weight_bytes, args)
    row = dict(
        batch=batch,
        decode_ms=1e3 * step,
        tokens_per_s=plain.tokens_per_s,
        busy=plain.busy,
        floor_ms=1e3 * floor,
        of_floor=floor / step,
        verify_ms={n: 1e3 * s for n, s in curve.items()},
        verify_in_decode_steps={n: s / step for n, s in curve.items()},
        speculative=speculative(model, draft, queue, batch, plain, curve, drafts, args),
    )
    kernels = profile_kernels(model, draft, prompts, loops, drafts, args) if args.profile else {}
    compared, compared_kernels = compare_backends(model, queue, batch, args)
    return dict(row, decode_ms_compared=compared, kernels={**kernels, **compared_kernels})


def main(argv=None):
    args = parse_args(argv)
    if args.device == "gpu" and jax.devices()[0].platform != "gpu":
        platform = jax.devices()[0].platform
        raise SystemExit(f"--device gpu, but JAX sees {platform}; use --device cpu")
    cli.use_compilation_cache(args.compilation_cache)
    models = trained if args.trained else random_models
    if args.check_greedy:
        trees = {name: TREES[name] for name in args.trees}  # `--no-spec` or not
        check_greedy(*models(args, dtype="float32"), trees, args)
    model, draft, prompt_rows = models(args)
    source = "given" if args.bandwidth else "measured"  # (the rate goes into the JSON's args)
    args.bandwidth = args.bandwidth or copy_bandwidth(2048 if args.device == "gpu" else 64)
    quoted = provenance(args)
    rate = f"copy rate {args.bandwidth / 1e12:.2f} TB/s ({source})"
    log(f"models ready; {rate}; every speedup below is at {json.dumps(quoted)}")
    weight_bytes = decode_weight_bytes(model)
    rows = []
    for b in args.batches:
        rows.append(measure(model, draft, queue(prompt_rows, b, args), b, weight_bytes, args))
        print_row(rows[-1])
        trees = {name: dataclasses.asdict(tree) for name, tree in timed_trees(args).items()}
        out = dict(args=vars(args), provenance=quoted, trees=trees, rows=rows)
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2))
    if not args.no_spec:
        print_choices(rows)


def provenance(args) -> dict:
    """What every speedup of the run is quoted with: its temperature and where its draft came
    from (its training steps, seconds and held-out top-1 agreement when train_code_lm trained
    it)."""
    if not args.trained:
        return dict(temperature=args.temperature, draft="random weights: speed only")
    run = pathlib.Path(args.trained)
    kind = trained_run.draft_kind(run, args.draft_kind)
    return dict(temperature=args.temperature, **trained_run.provenance(run, kind))


def queue_length(batch: int, args) -> int:
    """Prompts the loops of `generate` run at `batch` rows: `--prompts-per-row` per row, at least
    `--acceptance-rows`."""
    return max(batch * args.prompts_per_row, args.acceptance_rows)


def queue(prompt_rows: np.ndarray, batch: int, args) -> jax.Array:
    """The prompts of `batch` rows (`queue_length`), the distinct ones in turn."""
    return jnp.asarray(np.resize(prompt_rows, (queue_length(batch, args), args.prompt_len)))


def print_choices(rows) -> None:
    """The tree `choose_tree` takes at each batch from this run's costs and tokens per row-step,
    and its measured speedup (1.0: plain decoding)."""
    costs = StepCosts.from_rows(rows)
    for r in rows:
        accepted = {t: x["accepted_length"] * x["busy"] for t, x in r["speculative"].items()}
        tree, _ = choose_tree(costs, r["batch"], accepted, r["busy"])
        speedup = 1.0 if tree is None else r["speculative"][tree]["speedup"]
        print(f"batch {r['batch']:4d}: chosen {tree or 'plain decoding'}, speedup {speedup:.2f}x")


def random_draft(cfg, draft_vocab: int):
    """An EAGLE-3 draft of random weights for `cfg`, its vocabulary at most the target's."""
    return create_eagle3(Eagle3Config.for_target(cfg, min(draft_vocab, cfg.vocab_size)))


def prompt_count(args) -> int:
    """Distinct prompts a run can use: the queue of its largest batch."""
    return max(queue_length(b, args) for b in args.batches)


def random_models(args, dtype: str | None = None):
    """Target and draft of random weights (speed only), random prompts; `dtype` (parameters and
    compute) replaces the config's."""
    cfg = config_lib.load(args.config, args.overrides).model
    if dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    rng, shape = np.random.default_rng(0), (prompt_count(args), args.prompt_len)
    return create(cfg), random_draft(cfg, args.draft_vocab), rng.integers(0, cfg.vocab_size, shape)


def trained(args, dtype: str = "bfloat16"):
    """Target and draft of `--trained RUN_DIR` (the `--draft-kind` asked for) in `dtype`, and
    prompts from its held-out files (`jspec.bench.trained_run`)."""
    run = pathlib.Path(args.trained)
    kind = trained_run.draft_kind(run, args.draft_kind)
    return trained_run.load(run, kind, args.prompt_len, prompt_count(args), dtype)


def print_row(r) -> None:
    curve = ", ".join(f"{n}: {x:.2f}" for n, x in r["verify_in_decode_steps"].items())
    compared = "".join(f" ({name}: {ms:.2f})" for name, ms in r["decode_ms_compared"].items())
    parts = [
        f"batch {r['batch']:4d}",
        f"decode {r['decode_ms']:8.2f} ms" + compared,
        f"{r['tokens_per_s']:10,.0f} tok/s",
        f"floor {r['floor_ms']:.2f} ms ({100 * r['of_floor']:.0f}%)",
        f"verify/decode {curve}",
    ]
    parts += [
        f"{name} ({x['tree']}): step {x['step_in_decode_steps']:.2f} decodes (draft "
        f"{x['draft_in_decode_steps']:.2f}), accepted {x['accepted_length']:.2f}, speedup "
        f"{x['speedup']:.2f}x (predicted {x['predicted_speedup']:.2f}x)"
        for name, x in r["speculative"].items()
    ]
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(cli.run(main))
