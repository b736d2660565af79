"""Will it fit? Per-device memory and FLOPs of a config's train step and rollout on a mesh,
before booking the machines.

    python -m jspec.jobs.plan --config qwen3-8b-256k
    python -m jspec.jobs.plan --config qwen3-8b --mesh data=1,stage=1,context=8,tensor=8 \
        --seq-len 262144

The planner compiles the programs a run compiles (`jspec.rl.train.make_train_step` on packed rows,
and `jspec.sampler.rollout`, the speculative rollout) for the mesh, ahead of time, from abstract
arrays (`jax.ShapeDtypeStruct`, `nnx.eval_shape`): nothing of the model is allocated, so an 8B
model at 256K tokens plans on a laptop. It runs on as many virtual CPU devices as the mesh has,
and reports what XLA's SPMD partitioner gives one device (`memory_analysis`, `cost_analysis`):

- parameters and optimizer state: the train step's arguments, each leaf's shard;
- activations: the train step's temporary buffers (activations saved for the backward, gradients
  and every workspace buffer at the peak of the schedule);
- the rollout's temporaries: KV caches of policy and draft, logits and workspace;
- the peak of each program (arguments + temporaries + outputs not aliased to donated inputs), and
  its FLOPs (the rollout's while loop counted once: the prefill and one verify step).

    python -m jspec.jobs.plan --config code-rl --mesh data=1 --gpu  # a GPU machine's compiler
    python -m jspec.jobs.plan --config qwen3-8b-256k --gpu-topology 8x8   # 64 GPUs, on one

With `--gpu` the programs are compiled for this machine's GPUs (the mesh must fit them) by XLA's
GPU compiler, with the Pallas GPU kernels 'auto' picks there: the GPU's own figures, which
`jspec.bench.plan_check` compares with the memory the programs take when they run. With
`--gpu-topology HOSTSxGPUS` jax's CUDA plugin describes that many GPUs of this machine's kind as
compile-only devices (its one GPU gives the target and autotunes the kernels), and XLA partitions
the programs for them, collectives included: a cluster's figures from one of its GPUs.

    python -m jspec.jobs.plan --config qwen3-8b-256k --gpu-topology 8x8 --gpu-target h200

With `--gpu-target` (h100, h200: XLA's descriptions of those GPUs, in `jspec/jobs/gpu_targets/`;
or a file of the same form) the GPUs come from the description instead, so any machine with jax's
CUDA plugin (`pip install -e '.[gpu]'`) compiles them, no GPU needed: XLA's GPU compiler and the
Pallas GPU kernels, as a GPU run compiles them, but with no kernel autotuned (the local GPU's
figures and these are compared by `jspec.bench.plan_check`) and no FLOPs (XLA's cost analysis
needs the GPU). The device memory is jax's share of the described GPU's (75%, or
XLA_PYTHON_CLIENT_MEM_FRACTION).

With none of them, the CPU compiler schedules and fuses differently from the GPU's, so the report
calls itself a CPU estimate: `tests/test_plan.py` checks the activation figure against the memory a
CPU run actually takes, and a GPU compile of the same programs gives 1.1-2.7x lower peaks (the
Pallas attention kernels need less workspace than the CPU's blockwise attention; BENCHMARKS.md,
"The planner's report"). For a mixture of experts the report states what
its figures assume: experts per device, the dropless dispatch's receive buffers, and the CPU's
grouped matmuls, which copy their rows once per local expert where a Hopper GPU's kernels do not
(an upper estimate).

    python -m jspec.jobs.plan --config qwen3-8b-32k --topology v5p:2x2x2
    python -m jspec.jobs.plan --config qwen3-8b-32k --topology v5p:4x4x4 --mesh data=8,tensor=8

With `--topology GENERATION:SHAPE` (v5p:4x4x4, v4:2x2x2, v5e:4x4, v6e:4x4: the generation, then
the chips along each axis of the slice) the programs are compiled by XLA's TPU compiler instead,
still on this CPU: libtpu describes the slice's chips as compile-only devices, so no TPU is needed
and none is touched. The figures are then the TPU compiler's own (though no TPU has run the
programs); attention is the Pallas TPU kernels (`jspec.attention.pallas_tpu`, the block kernels
of the train step and the prefill, and `pallas_tpu_decode`, the rollout's few-query attention),
which 'auto' picks when lowering for a TPU. The device memory is the chip's HBM unless --memory
says otherwise. It needs libtpu: `pip install -e '.[tpu]'`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec.attention import target as attention_target
from jspec.config import ConfigError, RLConfig
from jspec.jobs import cli
from jspec.jobs.plan_devices import (
    GB,
    GPU_TARGETS,
    TOPOLOGIES,
    chip_count,
    count_mismatch,
    device_memory,
    gpu_target,
    hardware,
    mesh_devices,
)
from jspec.models.draft import Eagle3Config, Eagle3Draft, ExternalDraft
from jspec.models.transformer import Transformer
from jspec.pipeline.model import PipelinedTransformer
from jspec.rl.packing import PackedBatch
from jspec.rl.state import Networks, TrainState, moment_shardings, optimizer, trained_groups
from jspec.rl.train import make_train_step
from jspec.sampler import rollout


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.remat=dots")
    p.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    p.add_argument("--mesh", default=None, help="e.g. data=8,stage=1,context=1,tensor=8")
    p.add_argument("--seq-len", type=cli.at_least(2), default=None, help="tokens per training row")
    p.add_argument(
        "--rows",
        type=cli.at_least(1),
        default=None,
        help="training rows (default: mesh.data, times pipeline.microbatches: one row each)",
    )
    p.add_argument(
        "--rollout-batch", type=cli.at_least(1), default=None, help="default: data * context"
    )
    p.add_argument(
        "--memory",
        type=cli.positive,
        default=None,
        help="GB per device (default: an H200's 141; with --gpu what XLA may allocate of it;\n"
        "for a --topology the chip's HBM:\n"
        "v4 32, v5p 95, v5e 16, v6e 32; a v4 chip is two devices, 16 each)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="compile for this machine's GPUs with XLA's GPU compiler (the mesh must fit them):\n"
        "the GPU's own figures, not the CPU estimate",
    )
    p.add_argument(
        "--gpu-topology",
        default=None,
        metavar="HOSTSxGPUS",
        help="compile for HOSTS hosts of GPUS GPUs each (e.g. 8x8) with XLA's GPU compiler,\n"
        "on a machine with one GPU of the kind planned for: compile-only devices of its kind\n"
        "(its GPU autotunes the kernels), or of --gpu-target's kind on any machine;\n"
        "--mesh must multiply to HOSTS * GPUS",
    )
    p.add_argument(
        "--gpu-target",
        default=None,
        metavar="NAME|FILE",
        help="with --gpu-topology: compile on a machine with no GPU, for GPUs of this\n"
        f"description: {', '.join(sorted(GPU_TARGETS))} (XLA's) or a GpuTargetConfigProto\n"
        "text file. Needs jax's CUDA plugin (pip install -e '.[gpu]'); nothing is autotuned",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="compile for a TPU slice with XLA's TPU compiler, on this CPU:\n"
        "GENERATION:SHAPE, the chips along each axis of the slice,\n"
        f"e.g. {TOPOLOGIES} (not v5p-128 or v5litepod-16);\n"
        "--mesh must multiply to its device count. Needs libtpu: pip install -e '.[tpu]'",
    )
    return p.parse_args(argv)


class Figures(NamedTuple):
    """Per-device bytes and FLOPs of one compiled program."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    flops: float | None  # None: a compile without the GPU (--gpu-target) analyses no cost

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries + self.outputs - self.aliased

    @classmethod
    def of(cls, compiled) -> Figures:
        m = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        return cls(
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
            None if cost is None else float(cost.get("flops", 0.0)),
        )


class Plan(NamedTuple):
    parameters: int  # per device, policy and draft
    optimizer: int  # per device
    train: Figures
    rollout: Figures
    platform: str  # of the compiler that made the figures: "cpu", or "tpu" for a --topology
    device_kind: str  # "cpu", "TPU v5", "TPU v5 lite", ...
    chips: int  # a TPU v4 chip is two devices (its cores), other chips and CPU devices one
    kernels: tuple[str, ...]  # jspec's Pallas kernels in the compiled programs


def mesh_overrides(text: str | None) -> list[str]:
    """`data=8,tensor=8` as the config overrides `mesh.data=8`, `mesh.tensor=8` (the axes not
    named keep the config's value), applied with the others so that the config is checked
    against the mesh planned (a pipeline's stages against its stage axis)."""
    overrides = []
    for item in text.split(",") if text else ():
        name, _, value = item.partition("=")
        if name.strip() not in ("data", "stage", "context", "tensor") or not value.isdigit():
            raise ConfigError(
                f"--mesh item {item!r}: write axis=size for axes data, stage, context, tensor, "
                "e.g. --mesh data=8,context=1,tensor=8."
            )
        overrides.append(f"mesh.{name.strip()}={int(value)}")
    return overrides


def plan_config(args) -> tuple[config_lib.Config, int]:
    """The config to plan (mesh from --mesh, max_seq_len raised to --seq-len) and its seq len."""
    cfg = config_lib.load(args.config, [*args.overrides, *mesh_overrides(args.mesh)])
    if -1 in dataclasses.astuple(cfg.mesh):
        raise ConfigError(
            f"mesh {cfg.mesh} has an axis of -1 ('the devices left over'); the planner needs every "
            "size: pass --mesh data=..,stage=..,context=..,tensor=.. ."
        )
    seq_len = args.seq_len or cfg.model.max_seq_len
    if seq_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"--seq-len={seq_len} leaves no prompt before rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}; the rollout plans prompts of seq_len - max_new_tokens "
            "tokens: raise --seq-len or lower rollout.max_new_tokens."
        )
    if seq_len % (2 * cfg.mesh.context):
        raise ConfigError(
            f"--seq-len={seq_len} is not a multiple of 2 * context = {2 * cfg.mesh.context}: the "
            f"zigzag ring cuts a row into 2 * context chunks; pass a multiple of it."
        )
    model = dataclasses.replace(cfg.model, max_seq_len=max(seq_len, cfg.model.max_seq_len))
    return dataclasses.replace(cfg, model=model).validate(), seq_len


def on_one_device(config: str, overrides, seq_len: int, device):
    """(config, networks, abstract params) of `config` with `overrides`, rows of `seq_len` tokens,
    on a mesh of the one `device`: what a benchmark compiles a single program of."""
    one = "data=1,stage=1,context=1,tensor=1"
    given = argparse.Namespace(config=config, overrides=list(overrides), mesh=one, seq_len=seq_len)
    cfg, _ = plan_config(given)
    return cfg, *abstract_networks(cfg, mesh_lib.make_mesh(cfg.mesh, [device]))


def abstract_networks(cfg: config_lib.Config, mesh):
    """(Networks, abstract params) of the config's policy (pipelined over the stage axis when
    `pipeline.stages` > 1, as train_rl builds it) and draft: shapes, no values."""
    if cfg.pipeline.stages > 1:
        make = lambda: PipelinedTransformer(cfg.model, cfg.pipeline, rngs=nnx.Rngs(0), mesh=mesh)
    else:
        make = lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), mesh=mesh)
    policy = nnx.eval_shape(make)
    d = cfg.rollout.draft
    if d.path is not None:
        raise ConfigError(
            f"rollout.draft.path={d.path!r}: the planner builds drafts from their config; set "
            "rollout.draft.path=none (the draft's shape follows rollout.draft.kind and vocab_size)."
        )
    if d.kind == "eagle3":
        layer = Eagle3Config.for_target(cfg.model, d.vocab_size)
        draft = nnx.eval_shape(lambda: Eagle3Draft(layer, rngs=nnx.Rngs(0), mesh=mesh))
    elif d.kind == "external":
        draft = nnx.eval_shape(
            lambda: ExternalDraft(Transformer(d.model, rngs=nnx.Rngs(0), mesh=mesh))
        )
    else:
        draft = None
    networks, params = Networks.split(policy, draft, mesh)
    # Non-parameter constants (the draft's vocabulary map) are closed over: give them values.
    concrete = lambda net: net and net._replace(rest=_zeros(net.rest))
    networks = dataclasses.replace(
        networks, policy=concrete(networks.policy), draft=concrete(networks.draft)
    )
    return networks, _placed(params, networks.shardings(params))


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _placed(tree, shardings):
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
    )


def _bytes(tree) -> int:
    """Per-device bytes of a tree of placed abstract arrays: each leaf's shard."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def train_step(cfg: config_lib.Config, networks, params, seq_len: int, rows: int):
    """(compiled train step, its abstract state, its abstract batch): one GRPO + co-training
    update on `rows` packed rows of `seq_len` tokens, split over the data axis."""
    mesh = networks.mesh
    rl = cfg.rl or RLConfig(sequences_per_row=1)
    trained = trained_groups("cotrain", networks.draft is not None)
    tx = optimizer(rl, trained, rl.learning_rate)
    trainable = {k: params[k] for k in trained}
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, trainable)  # placed as `init_state` places it
    opt_state = _placed(abstract, moment_shardings(abstract, trainable, mesh))
    scalar = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    state = TrainState(params, opt_state, None, scalar((), jnp.int32), scalar((2,), jnp.uint32))
    row_sharding = NamedSharding(mesh, PartitionSpec(mesh_lib.RULES["batch"]))
    column = lambda dtype: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=row_sharding)
    batch = PackedBatch(
        *(column(jnp.int32) for _ in range(3)),
        column(jnp.bool_),
        column(jnp.float32),
        column(jnp.float32),
        column(jnp.int32),
    )
    step = make_train_step(
        networks, tx, trained, rl, cfg.rollout, num_sequences=rows * rl.sequences_per_row
    )
    with attention_target.compiling_for(mesh):
        compiled = step.lower(state, batch).compile()
    return compiled, state, batch


def rollout_step(cfg: config_lib.Config, networks, params, prompt_len: int, batch: int):
    """(compiled rollout, its abstract arguments): the speculative rollout of `batch` prompts of
    `prompt_len` tokens, its rows split over data x context as `jspec.jobs.train_rl` places them."""

    def run(params, prompts, lengths, key):
        policy, draft = networks.models(params)
        return rollout(policy, draft, prompts, lengths, key, cfg.rollout)

    rows = NamedSharding(networks.mesh, PartitionSpec(mesh_lib.RULES["decode_batch"]))
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rows)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    # Abstract like every other argument: the program is compiled, never run, and a concrete key
    # would be an array on this process's CPU rather than on the mesh's devices.
    key_type = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(
        key_type.shape, key_type.dtype, sharding=NamedSharding(networks.mesh, PartitionSpec())
    )
    args = (params, prompts, lengths, key)
    with attention_target.compiling_for(networks.mesh):
        return jax.jit(run).lower(*args).compile(), args


def check_batches(cfg: config_lib.Config, rows: int, rollout_batch: int) -> None:
    """Raises ConfigError unless the training rows split over mesh.data (per microbatch of a
    pipeline) and the rollout's rows over mesh.data x mesh.context, as a run places them."""
    data, context = cfg.mesh.data, cfg.mesh.context
    if rows % data or rows <= 0:
        raise ConfigError(
            f"--rows={rows} training rows do not split over mesh.data={data}; pass a multiple "
            f"of {data}."
        )
    cfg.pipeline.check_rows(rows // data, where="pipeline (--rows)")
    if rollout_batch % (data * context) or rollout_batch <= 0:
        raise ConfigError(
            f"--rollout-batch={rollout_batch} rows do not split over mesh.data x mesh.context = "
            f"{data * context}; pass a multiple of {data * context}."
        )


def plan(
    cfg: config_lib.Config,
    seq_len: int,
    devices,
    rows: int | None = None,
    rollout_batch: int | None = None,
) -> Plan:
    """Compiles both programs for `devices` (`mesh_devices`), one per mesh position in order; a
    mesh that does not fit them is refused before anything compiles."""
    sizes = dataclasses.asdict(cfg.mesh)
    if len(devices) != math.prod(sizes.values()):
        raise ConfigError(count_mismatch(sizes, devices))
    rows = rows or sizes["data"] * cfg.pipeline.microbatches
    decode = rollout_batch or sizes["data"] * sizes["context"]
    check_batches(cfg, rows, decode)
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    networks, params = abstract_networks(cfg, mesh)
    train, state, _ = train_step(cfg, networks, params, seq_len, rows)
    new_tokens = cfg.rollout.max_new_tokens
    roll, _ = rollout_step(cfg, networks, params, seq_len - new_tokens, decode)
    return Plan(
        _bytes(state.params),
        _bytes(state.opt_state),
        Figures.of(train),
        Figures.of(roll),
        devices[0].platform,
        devices[0].device_kind,
        chip_count(devices),
        tuple(
            sorted({_kernel_name(k) for c in (train, roll) for k in _KERNEL.findall(c.as_text())})
        ),
    )


# A Pallas kernel's name in compiled HLO; XLA numbers its copies and Mosaic GPU's lowering adds
# `_mosaic_gpu`, both folded into the kernel's own name.
_KERNEL = re.compile(r"jspec_\w+")


def _kernel_name(name: str) -> str:
    return re.sub(r"(_\d+|_mosaic_gpu)+$", "", name)


def _size(nbytes: int) -> str:
    """GB for real models, MB for the small ones of tests and notebooks."""
    return f"{nbytes / GB:>9.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:>9.2f} MB"


def _flop(n: float) -> str:
    """TFLOP for real models, GFLOP for the small ones (whose TFLOP would read 0.0)."""
    return f"{n / 1e12:>9.1f} TFLOP" if n >= 1e11 else f"{n / 1e9:>9.2f} GFLOP"


CPU_OVER_GPU = "1.1-2.7x"  # BENCHMARKS.md, "The planner's report"


def target(
    p: Plan, devices: int, topology: str | None = None, gpu_target: str | None = None
) -> str:
    """The report's first line: whose figures these are (the compiler and its jax version, and for
    a slice or cluster its topology and chips, and the description of GPUs compiled for without
    one), so no one reads them as another machine's or another version's."""
    name = "GPU" if p.platform in ("gpu", "cuda", "rocm") else p.platform.upper()
    compiler = f"XLA {name} compiler of jax {jax.__version__}"
    if topology is not None:
        chips = hardware(devices, p.chips, p.device_kind)
        described = f"; from --gpu-target {gpu_target}, no GPU: untuned" if gpu_target else ""
        return f"{name} compile ({compiler} for topology {topology}, {chips}{described})"
    if p.platform == "cpu":
        virtual = f"{devices} virtual device{'s' * (devices > 1)}"
        return f"CPU estimate ({compiler} on {virtual}; {CPU_OVER_GPU} a GPU compile's peak)"
    return f"{name} compile ({compiler} for {devices} {p.device_kind})"


def moe_assumptions(
    cfg: config_lib.Config, platform: str = "cpu", gpu_target: str | None = None
) -> list[str]:
    """What the figures of a mixture of experts assume (`jspec.models.moe`); none for a dense
    model. The experts are split over `RULES["expert"]`, and each device receives into P times its
    own assignments (the worst case: every device routes all its tokens to it), which is how the
    routing stays dropless with static shapes. The note on the CPU's grouped matmuls, which copy
    their rows per local expert, is left out of a TPU or GPU compile: its figures are the
    compiler's own. A GPU compiled for from its description gets `lax.ragged_dot`: JAX's Mosaic
    kernels, which a Hopper GPU runs, read the local GPU when they compile."""
    m = cfg.model
    if not m.num_experts:
        return []
    sizes = dataclasses.asdict(cfg.mesh)
    group = mesh_lib.axis_size(AbstractMesh(tuple(sizes.values()), tuple(sizes)), "expert")
    local = m.num_experts // group
    dispatch = (
        f"each device receives into {group}x its own assignments (every device's tokens to it)"
        if group > 1
        else "one device holds every expert, no exchange"
    )
    mosaic = "a Hopper GPU runs JAX's Mosaic kernels, which compile only on one"
    copies = (
        "  temporaries are an upper estimate: the CPU's grouped matmuls copy their rows per local "
        f"expert ({local}x), a Hopper GPU's kernels do not"
    )
    return [
        f"mixture of experts: {local} of {m.num_experts} experts per device (split over "
        f"{' x '.join(mesh_lib.RULES['expert'])}, {group} devices), top-{m.num_experts_per_tok}, "
        f"{sum(m.sparse_layers)} of {m.num_layers} layers",
        f"  dropless, no capacity factor: {dispatch}",
        *([copies] if platform == "cpu" else []),
        *([f"  grouped products as lax.ragged_dot: {mosaic}"] if gpu_target else []),
    ]


def report(
    cfg: config_lib.Config,
    p: Plan,
    seq_len: int,
    memory_gb: float,
    topology: str | None = None,
    gpu_target: str | None = None,
) -> str:
    sizes = dataclasses.asdict(cfg.mesh)
    mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
    verdict = lambda peak: "fits" if peak <= memory_gb * GB else "DOES NOT FIT"
    line = lambda name, value, note="": f"  {name:<38}{_size(value)}  {note}".rstrip()
    flops = lambda f, note="": (
        f"  {'FLOPs per device':<38}"
        + ("not known (XLA analyses no cost without the GPU)" if f is None else _flop(f) + note)
    )
    t, r = p.train, p.rollout
    return "\n".join(
        [
            f"{target(p, math.prod(sizes.values()), topology, gpu_target)} of {cfg.name}",
            f"mesh {mesh}, {seq_len:,} tokens per training row, device memory {memory_gb:g} GB",
            *moe_assumptions(cfg, p.platform, gpu_target),
            "train step (GRPO + draft co-training, one update)",
            line("parameters (policy + draft)", p.parameters),
            line("optimizer state", p.optimizer),
            line("activations and temporaries", t.temporaries, "(saved for backward, grads, work)"),
            line("peak", t.peak, verdict(t.peak)),
            flops(t.flops),
            f"rollout ({cfg.rollout.max_new_tokens:,} new tokens, speculative)",
            line("parameters", r.arguments),
            line("KV caches and temporaries", r.temporaries),
            line("peak", r.peak, verdict(r.peak)),
            flops(r.flops, "  (prefill + one verify step)"),
            f"  {'Pallas kernels':<38}{', '.join(p.kernels) or 'none (attention in XLA)'}",
        ]
    )


def main(argv=None) -> Plan:
    args = parse_args(argv)
    cfg, seq_len = plan_config(args)
    if args.gpu and args.gpu_topology:
        raise ConfigError("--gpu and --gpu-topology: the second names the GPUs; give one of them.")
    if args.gpu_target and not args.gpu_topology:
        raise ConfigError(
            "--gpu-target describes the GPUs, --gpu-topology HOSTSxGPUS says how many: give "
            "both (e.g. --gpu-topology 1x8 for one host of 8)."
        )
    described = args.gpu_target and gpu_target(args.gpu_target)
    devices = mesh_devices(args.topology, cfg.mesh, args.gpu_topology or args.gpu, described)
    memory = device_memory(devices, args.memory, args.topology, described)
    result = plan(cfg, seq_len, devices, args.rows, args.rollout_batch)
    topology = args.topology or args.gpu_topology
    print(report(cfg, result, seq_len, memory, topology, args.gpu_target))
    return result


if __name__ == "__main__":
    sys.exit(cli.run(main))
