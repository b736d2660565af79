"""Benchmark of the pipelined policy: train-step time with the taps off and on, and the bubble.

    python -m jspec.bench.pipeline --device cpu   # tiny model, 2 and 4 stages, 8 CPUs
    python -m jspec.bench.pipeline --device gpu   # Qwen3-0.6B, 2 stages on 2 GPUs

For each pipeline (stages S, microbatches M, repeats R) it times the jitted forward + backward of
the pipelined policy (`jspec.pipeline`) on `--batch` rows of `--seq` tokens: with the taps off (the
loss is the mean token log-likelihood), and with the taps on (the TapChannel delivers them to the
draft's stage, where the loss reads them, detached, so none of it is dead code). It reports the
taps' overhead in percent, the schedule's bubble (S - 1) / (M * R + S - 1), and a measured idle
fraction 1 - t1 / (S * t): t1 is the unpipelined policy's step on one device for the same batch
(on virtual CPU devices, which share the host's cores, that measure means little). The mesh is
`--data` x stages devices. Prints a table and writes JSON to `--json`.

Attention runs in the Pallas kernels inside the stages (`impl='auto'`: the model's attention is a
`shard_map`, which the vmap over the stage axis splits, so each device calls the kernels on its own
stage's microbatch: tests/test_gpu_compile.py); `--attention pallas` the Triton kernel where the
Mosaic GPU one would run, `--attention xla` XLA's blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from jspec import mesh as mesh_lib
from jspec.bench.attention import AUTO_KERNELS, restrict_auto
from jspec.jobs import cli

DEFAULTS = {  # device: (config, overrides, batch, seq, stages, microbatches, repeats)
    "cpu": ("tiny", ["model.remat=full"], 8, 64, [2, 4], [4, 8], [1, 2]),
    "gpu": ("qwen3-0.6b", ["model.remat=full"], 16, 2048, [2], [4, 8], [1, 2]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=tuple(DEFAULTS), default="cpu")
    p.add_argument("--config", default=None, help="model config (default: see above)")
    p.add_argument("--set", nargs="*", default=None, help="dotted overrides, model.x=y")
    p.add_argument("--batch", type=cli.at_least(1), default=None, help="rows per step")
    p.add_argument("--seq", type=cli.at_least(1), default=None, help="tokens per row")
    p.add_argument("--stages", type=cli.at_least(1), nargs="+", default=None)
    p.add_argument("--microbatches", type=cli.at_least(1), nargs="+", default=None)
    p.add_argument("--repeats", type=cli.at_least(1), nargs="+", default=None)
    p.add_argument("--data", type=cli.at_least(1), default=1, help="size of the mesh's data axis")
    p.add_argument("--attention", choices=AUTO_KERNELS, default="auto", help="see above")
    p.add_argument("--iters", type=cli.at_least(1), default=10)
    p.add_argument("--json", default="runs/bench_pipeline/results.json")
    args = p.parse_args(argv)
    config, overrides, batch, seq, stages, micro, repeats = DEFAULTS[args.device]
    args.config = args.config or config
    args.set = overrides if args.set is None else args.set
    args.batch, args.seq = args.batch or batch, args.seq or seq
    args.stages = args.stages or stages
    args.microbatches = args.microbatches or micro
    args.repeats = args.repeats or repeats
    return args


def step_fn(taps: bool):
    """Gradients of the mean token log-likelihood (and, with `taps`, the delivered taps' mean
    square, detached: the draft's stage reads them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def loss(params, graphdef, rest, tokens):
        out = nnx.merge(graphdef, params, rest)(tokens, features="taps" if taps else None)
        logits, tapped = out if taps else (out, None)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        if taps:
            nll += jnp.mean(jax.lax.stop_gradient(tapped).astype(jnp.float32) ** 2)
        return nll

    return jax.jit(jax.grad(loss), static_argnums=1)


def time_step(model, tokens, taps: bool, iters: int) -> float:
    """Median milliseconds of `iters` steps (after one compiling call)."""
    import jax
    import numpy as np
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = step_fn(taps)
    jax.block_until_ready(step(params, graphdef, rest, tokens))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(params, graphdef, rest, tokens))
        times.append(1e3 * (time.perf_counter() - start))
    return float(np.median(times))


def pipelines(args, model, num_devices: int):
    """The pipelines to run: those the model, the batch and the devices allow."""
    from jspec.config import ConfigError, MeshConfig, PipelineConfig

    for s in args.stages:
        for m in args.microbatches:
            for r in args.repeats:
                pipeline = PipelineConfig(stages=s, microbatches=m, repeats=r)
                try:
                    pipeline.validate(model, MeshConfig(stage=s))
                    pipeline.check_rows(args.batch // args.data)
                except ConfigError as error:
                    print(f"skipped S={s} M={m} R={r}: {error}")
                    continue
                if s * args.data <= num_devices:
                    yield pipeline


def measure(args) -> dict:
    """The benchmark's rows: one unpipelined baseline, then every pipeline."""
    import jax
    import numpy as np

    from jspec import config as config_lib
    from jspec import mesh as mesh_lib
    from jspec.config import MeshConfig
    from jspec.models import create
    from jspec.pipeline import Schedule
    from jspec.pipeline import create as create_pipelined

    model = config_lib.load(args.config, args.set).model
    model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, args.seq))
    devices = jax.devices()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (args.batch, args.seq)).astype(np.int32)
    one = create(model, seed=0)
    t1 = time_step(one, jax.device_put(tokens, devices[0]), False, args.iters)
    rows = [{"stages": 1, "microbatches": 1, "repeats": 1, "data": 1, "ms_taps_off": t1}]
    print(rows[0], flush=True)
    data = args.data
    for pipeline in pipelines(args, model, len(devices)):
        s = pipeline.stages
        mesh = mesh_lib.make_mesh(MeshConfig(data=data, stage=s), devices[: data * s])
        policy = create_pipelined(model, pipeline, mesh=mesh, seed=0)
        x = jax.device_put(tokens, mesh_lib.sharding(mesh, ("batch", None)))
        off, on = (time_step(policy, x, taps, args.iters) for taps in (False, True))
        schedule = Schedule.of(pipeline, model.num_layers)
        rows.append(
            {
                "stages": s,
                "microbatches": pipeline.microbatches,
                "repeats": pipeline.repeats,
                "data": data,
                "ms_taps_off": off,
                "ms_taps_on": on,
                "taps_overhead_pct": 100 * (on / off - 1),
                "bubble": schedule.bubble,
                "idle_measured": 1 - t1 / (s * data * off),
            }
        )
        print(rows[-1], flush=True)
    return {"args": vars(args), "device": devices[0].device_kind, "rows": rows}


def print_table(result: dict) -> None:
    cols = (
        "stages",
        "microbatches",
        "repeats",
        "data",
        "ms_taps_off",
        "ms_taps_on",
        "taps_overhead_pct",
        "bubble",
        "idle_measured",
    )
    print(f"\n{result['device']}, batch {result['args']['batch']} x {result['args']['seq']}")
    print(" | ".join(f"{c:>12}" for c in cols))
    for row in result["rows"]:
        cells = (row.get(c, "") for c in cols)
        print(" | ".join(f"{c:>12.3f}" if isinstance(c, float) else f"{c!s:>12}" for c in cells))


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        mesh_lib.use_cpu_devices(8)
    restrict_auto(args.attention)
    result = measure(args)
    print_table(result)
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
