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

The CPU compiler schedules and fuses differently from the GPU's, so the report calls itself a CPU
estimate: `tests/test_plan.py` checks the activation figure against the memory a CPU run actually
takes, and a GPU compile of the same train step has measured 1.5-1.8x lower temporaries (the cuDNN
/ Pallas attention kernels need less workspace than the CPU's blockwise attention; BENCHMARKS.md,
"The planner's report"). For a mixture of experts the report states what its figures assume:
experts per device, the dropless dispatch's receive buffers, and the CPU's grouped matmuls, which
copy their rows once per local expert where a Hopper GPU's kernels do not (an upper estimate).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec.config import ConfigError, RLConfig
from jspec.jobs import cli
from jspec.models.draft import Eagle3Config, Eagle3Draft, ExternalDraft
from jspec.models.transformer import Transformer
from jspec.rl.packing import PackedBatch
from jspec.rl.state import Networks, TrainState, moment_shardings, optimizer, trained_groups
from jspec.rl.train import make_train_step
from jspec.sampler import rollout

GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.remat=dots")
    p.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    p.add_argument("--mesh", default=None, help="e.g. data=8,stage=1,context=1,tensor=8")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training row")
    p.add_argument("--rows", type=int, default=None, help="training rows (default: mesh.data)")
    p.add_argument("--rollout-batch", type=int, default=None, help="default: data * context")
    p.add_argument("--memory", type=float, default=141.0, help="GB per device (H200: 141)")
    return p.parse_args(argv)


class Figures(NamedTuple):
    """Per-device bytes and FLOPs of one compiled program."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    flops: float

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
            float(cost.get("flops", 0.0)),
        )


class Plan(NamedTuple):
    parameters: int  # per device, policy and draft
    optimizer: int  # per device
    train: Figures
    rollout: Figures
    platform: str  # of the compiler that made the figures: "cpu" from `main`


def mesh_sizes(text: str | None, default: config_lib.MeshConfig) -> config_lib.MeshConfig:
    """`data=8,tensor=8` over the config's mesh (the axes not named keep their value)."""
    if not text:
        return default
    sizes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in ("data", "stage", "context", "tensor") or not value.isdigit():
            raise ConfigError(
                f"--mesh item {item!r}: write axis=size for axes data, stage, context, tensor, "
                "e.g. --mesh data=8,context=1,tensor=8."
            )
        sizes[name.strip()] = int(value)
    return dataclasses.replace(default, **sizes)


def plan_config(args) -> tuple[config_lib.Config, int]:
    """The config to plan (mesh from --mesh, max_seq_len raised to --seq-len) and its seq len."""
    cfg = config_lib.load(args.config, args.overrides)
    mesh = mesh_sizes(args.mesh, cfg.mesh)
    if -1 in dataclasses.astuple(mesh):
        raise ConfigError(
            f"mesh {mesh} has an axis of -1 ('the devices left over'); the planner needs every "
            "size: pass --mesh data=..,stage=..,context=..,tensor=.. ."
        )
    seq_len = args.seq_len or cfg.model.max_seq_len
    if seq_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"--seq-len={seq_len} leaves no prompt before rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}; the rollout plans prompts of seq_len - max_new_tokens "
            "tokens: raise --seq-len or lower rollout.max_new_tokens."
        )
    model = dataclasses.replace(cfg.model, max_seq_len=max(seq_len, cfg.model.max_seq_len))
    return dataclasses.replace(cfg, mesh=mesh, model=model).validate(), seq_len


def abstract_networks(cfg: config_lib.Config, mesh):
    """(Networks, abstract params) of the config's policy and draft: shapes, no values."""
    policy = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), mesh=mesh))
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
    compiled = step.lower(state, batch).compile()
    return compiled, state, batch


def rollout_step(cfg: config_lib.Config, networks, params, prompt_len: int, batch: int):
    """The compiled speculative rollout of `batch` prompts of `prompt_len` tokens, its rows split
    over data x context as `jspec.jobs.train_rl` places them."""

    def run(params, prompts, lengths, key):
        policy, draft = networks.models(params)
        return rollout(policy, draft, prompts, lengths, key, cfg.rollout)

    rows = NamedSharding(networks.mesh, PartitionSpec(mesh_lib.RULES["decode_batch"]))
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rows)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    key = jax.random.key(0)
    return jax.jit(run).lower(params, prompts, lengths, key).compile()


def plan(
    cfg: config_lib.Config, seq_len: int, rows: int | None = None, rollout_batch: int | None = None
) -> Plan:
    """Compiles both programs on the first devices of this process, one per mesh position."""
    sizes = dataclasses.asdict(cfg.mesh)
    need = math.prod(sizes.values())
    if len(jax.devices()) < need:
        raise ConfigError(
            f"mesh {sizes} needs {need} devices, this process has {len(jax.devices())}; run "
            "`python -m jspec.jobs.plan` (it makes the virtual CPU devices), or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before jax starts."
        )
    mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:need])
    networks, params = abstract_networks(cfg, mesh)
    rows = rows or sizes["data"]
    train, state, _ = train_step(cfg, networks, params, seq_len, rows)
    new_tokens = cfg.rollout.max_new_tokens
    decode = rollout_batch or sizes["data"] * sizes["context"]
    roll = rollout_step(cfg, networks, params, seq_len - new_tokens, decode)
    return Plan(
        _bytes(state.params),
        _bytes(state.opt_state),
        Figures.of(train),
        Figures.of(roll),
        mesh.devices.flat[0].platform,
    )


def _size(nbytes: int) -> str:
    """GB for real models, MB for the small ones of tests and notebooks."""
    return f"{nbytes / GB:>9.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:>9.2f} MB"


def _flop(n: float) -> str:
    """TFLOP for real models, GFLOP for the small ones (whose TFLOP would read 0.0)."""
    return f"{n / 1e12:>9.1f} TFLOP" if n >= 1e11 else f"{n / 1e9:>9.2f} GFLOP"


def target(platform: str, devices: int) -> str:
    """The report's first line: whose figures these are (the compiler and its jax version), so no
    one reads them as a GPU's or as another version's."""
    name = platform.upper()
    virtual = " virtual" if platform == "cpu" else ""
    kind = "estimate" if platform == "cpu" else "compile"
    where = f"{devices}{virtual} device{'s' * (devices > 1)}"
    return f"{name} {kind} (XLA {name} compiler of jax {jax.__version__} on {where})"


def moe_assumptions(cfg: config_lib.Config) -> list[str]:
    """What the figures of a mixture of experts assume (`jspec.models.moe`); none for a dense
    model. The experts are split over `RULES["expert"]`, and each device receives into P times its
    own assignments (the worst case: every device routes all its tokens to it), which is how the
    routing stays dropless with static shapes."""
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
    return [
        f"mixture of experts: {local} of {m.num_experts} experts per device (split over "
        f"{' x '.join(mesh_lib.RULES['expert'])}, {group} devices), top-{m.num_experts_per_tok}, "
        f"{sum(m.sparse_layers)} of {m.num_layers} layers",
        f"  dropless, no capacity factor: {dispatch}",
        "  temporaries are an upper estimate: the CPU's grouped matmuls copy their rows per local "
        f"expert ({local}x), a Hopper GPU's kernels do not",
    ]


def report(cfg: config_lib.Config, p: Plan, seq_len: int, memory_gb: float) -> str:
    sizes = dataclasses.asdict(cfg.mesh)
    mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
    verdict = lambda peak: "fits" if peak <= memory_gb * GB else "DOES NOT FIT"
    line = lambda name, value, note="": f"  {name:<38}{_size(value)}  {note}".rstrip()
    flops = lambda f: f"  {'FLOPs per device':<38}{_flop(f)}"
    t, r = p.train, p.rollout
    return "\n".join(
        [
            f"{target(p.platform, math.prod(sizes.values()))} of {cfg.name}",
            f"mesh {mesh}, {seq_len:,} tokens per training row, device memory {memory_gb:g} GB",
            *moe_assumptions(cfg),
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
            flops(r.flops) + "  (prefill + one verify step)",
        ]
    )


def main(argv=None) -> Plan:
    args = parse_args(argv)
    cfg, seq_len = plan_config(args)
    need = math.prod(dataclasses.astuple(cfg.mesh))
    mesh_lib.use_cpu_devices(need)  # one per mesh position; jax has not started its backend yet
    result = plan(cfg, seq_len, args.rows, args.rollout_batch)
    print(report(cfg, result, seq_len, args.memory))
    return result


if __name__ == "__main__":
    sys.exit(cli.run(main))
