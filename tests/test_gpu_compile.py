"""What XLA's GPU compiler makes of jspec's programs, compiled on this CPU for H200s from their
description (`jspec.bench.kernel_census`, as `jspec.jobs.plan --gpu-target` compiles): the
decode loop's kernels, where a layer's weights are read once and never written; a pipeline's
attention kernels, run inside its stages. Needs jax's
CUDA plugin (`pip install -e '.[gpu]'`, there on the GPU machines); without it the tests skip
and say so."""

import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench import kernel_census
from jspec.jobs import plan, plan_devices
from jspec.mesh import make_mesh

pytestmark = pytest.mark.skipif(
    not plan_devices.has_cuda_plugin(),
    reason="jax's CUDA plugin (XLA's GPU compiler) is not installed: pip install -e '.[gpu]'",
)
# Small enough that XLA's GPU compiler turns each of a decode step's products into a reduction
# (it does so up to about 8M weights), large enough that a weight outweighs every activation.
MODEL = ["model.hidden_size=512", "model.num_heads=4", "model.num_kv_heads=2"]
MODEL += ["model.head_dim=128", "model.intermediate_size=1024"]
HIDDEN, WIDTH, MLP = 512, 4 * 128, 1024


@functools.cache
def decode_kernels(batch: int, layers: int) -> list:
    """The kernels of the decode loop's body of the tiny config at `MODEL` with `layers` layers,
    compiled for an H200 (once: tests share it)."""
    argv = ["--config", "tiny", "--batch", str(batch), "--prompt", "48", "--new", "16", *MODEL]
    args = kernel_census.parse_args([*argv, f"model.num_layers={layers}"])
    compiled, _ = kernel_census.compile_rollout(args)
    return kernel_census.decode_loop(kernel_census.loop_bodies(compiled.as_text()))


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_writes_no_weight_sized_array(batch):
    """Every product of a decode step reads its weight once: no kernel of the loop writes an
    array as large as the smallest weight (the attention output's, H*E x D), as XLA's GPU
    compiler does for a matrix-vector product over a small weight stored inputs first."""
    kernels = decode_kernels(batch, 2)
    assert len(kernels) > 10 * 2, kernels  # the decode loop's body
    largest = max(kernels, key=lambda k: k.elements)
    assert largest.elements < min(WIDTH * HIDDEN, HIDDEN * MLP), largest


# A layer's kernels in a decode step as jax 0.10 compiles it (Qwen3's q/k norms, folded
# input norms): the products, the q/k/v epilogue (norms, rotary, cache writes:
# `jspec.models.qkv_epilogue`), the attention kernel and its merge, residual adds and the MLP's
# activation. More is a fusion lost.
LAYER_KERNELS = {1: 10, 8: 12}


@pytest.mark.parametrize("batch", sorted(LAYER_KERNELS))
def test_a_decode_layer_launches_few_kernels(batch):
    """What one more layer adds to a decode step's kernels stays within its budget."""
    two, four = (len(decode_kernels(batch, n)) for n in (2, 4))
    assert (four - two) / 2 <= LAYER_KERNELS[batch], (two, four)


def test_the_census_prints_its_table(capsys, tmp_path):
    out = tmp_path / "census.json"
    kernel_census.main(["--config", "tiny", "--prompt", "48", "--new", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("tiny, batch 1, plain decoding, for h200:\n")
    assert "a layer:" in printed and "writes of 1,048,576 elements or more: none" in printed
    assert "by part: target_forward " in printed
    assert out.exists()


def test_the_census_counts_each_part_of_a_speculative_step(capsys, tmp_path):
    """The draft's tree, the target's forward, verification, the caches' advance and the draft's
    extension each launch kernels of their own, and together nearly all of the step's."""
    argv = ["--config", "demo", "--prompt", "48", "--new", "16", "--draft"]  # a sampled chain
    kernel_census.main([*argv, "--out", str(tmp_path / "c.json")])
    kernels = [kernel_census.Kernel(**k) for k in json.loads((tmp_path / "c.json").read_text())]
    parts = collections.Counter(kernel_census.parts(kernels))
    assert all(parts[p] for p in kernel_census.PARTS), parts
    assert parts["other"] < 0.25 * len(kernels), parts
    assert "by part: draft_tree " in capsys.readouterr().out


def train_step_text(argv: list[str], mesh: str, topology: str) -> str:
    """The compiled text of the planner's train step of `argv` on `mesh`, for H200s."""
    cfg, seq_len = plan.plan_config(plan.parse_args([*argv, "--mesh", mesh]))
    devices = plan_devices.gpu_topology_devices(topology, plan_devices.gpu_target("h200"))
    networks, params = plan.abstract_networks(cfg, make_mesh(cfg.mesh, devices))
    compiled, _, _ = plan.train_step(cfg, networks, params, seq_len, rows=2)
    return compiled.as_text()


def test_a_pipeline_runs_the_attention_kernels_inside_its_stages():
    """Two stages on two H200s: the train step calls the Pallas attention kernels (forward,
    dK/dV, dQ) inside the stages' vmap, each device on its own stage's microbatch, and gathers
    nothing (the stage's attention is a shard_map that the vmap over the stage axis splits)."""
    argv = ["--config", "tiny", "--seq-len", "128", "rollout.max_new_tokens=16"]
    argv += ["model.num_layers=4", "pipeline.stages=2", "pipeline.microbatches=2"]
    text = train_step_text(argv, "data=1,stage=2", "1x2")
    in_stages = [line for line in text.splitlines() if "/vmap(" in line and "pallas_call" in line]
    kernels = set(re.findall(r"jspec_attention_\w+", "\n".join(in_stages)))
    assert kernels == {"jspec_attention_fwd", "jspec_attention_dkdv", "jspec_attention_dq"}
    assert "collective-permute" in text and "all-gather" not in text


def mosaic_calls(fn, *shapes) -> dict[str, str]:
    """The Mosaic GPU kernels of `fn` compiled for an H200 on arguments of `shapes` ((shape,
    dtype) pairs), by kernel name."""
    from jax.sharding import Mesh, SingleDeviceSharding

    from jspec.attention import target

    [device] = plan_devices.gpu_topology_devices("1x1", plan_devices.gpu_target("h200"))
    args = [jax.ShapeDtypeStruct(*s, sharding=SingleDeviceSharding(device)) for s in shapes]
    with target.compiling_for(Mesh(np.array([device]), ("x",))):
        text = jax.jit(fn).lower(*args).compile().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="mosaic_gpu' in line]
    named = {re.search(r"jspec_attention_mosaic_\w+", line).group(): line for line in calls}
    assert len(named) == len(calls), calls
    return named


# Packed rows, GQA, a length that is not whole tiles.
B, T, HQ, HKV, D = 2, 1000, 8, 2, 128
QKV_IDS = [((B, T, HQ, D), jnp.bfloat16), *[((B, T, HKV, D), jnp.bfloat16)] * 2]
QKV_IDS += [((B, T), jnp.int32)] * 2


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="the Mosaic GPU kernel needs jax >= 0.11")
def test_the_mosaic_kernel_compiles_for_a_hopper_gpu():
    """The gradient of `attention(impl="mosaic")` compiles for an H200: one Mosaic GPU kernel
    forward, which has nothing to continue and writes outputs of its own (none aliases a buffer
    it is given: no zeros written first; o in bfloat16, the one dtype kept of it), and one
    backward, which accumulates dq in place."""
    from jspec.attention import attention

    def loss(q, k, v, seg, pos):
        return attention(q, k, v, seg, pos, impl="mosaic").astype(jnp.float32).sum()

    calls = mosaic_calls(jax.grad(loss, argnums=(0, 1, 2)), *QKV_IDS)
    assert sorted(calls) == ["jspec_attention_mosaic_bwd", "jspec_attention_mosaic_fwd"]
    assert "output_to_operand_aliasing" not in calls["jspec_attention_mosaic_fwd"]
    assert re.search(r"= \(bf16\[2,1024,8,128\]", calls["jspec_attention_mosaic_fwd"])
    assert "output_to_operand_aliasing" in calls["jspec_attention_mosaic_bwd"]


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="the Mosaic GPU kernel needs jax >= 0.11")
def test_the_mosaic_forward_continues_a_running_output_in_place():
    """Given a running (o, lse), as a ring step is, the forward kernel continues it in place: its
    outputs alias both buffers."""
    from jspec.attention import mosaic_gpu

    def step(q, k, v, seg, pos, o, lse):
        return mosaic_gpu.fwd(q, k, v, seg, pos, seg, pos, (o, lse), scale=D**-0.5)

    acc = [((B, T, HQ, D), jnp.float32), ((B, T, HQ), jnp.float32)]
    [call] = mosaic_calls(step, *QKV_IDS, *acc).values()
    assert "output_to_operand_aliasing={{0}" in call and "{1}" in call


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="the Mosaic GPU kernel needs jax >= 0.11")
def test_the_train_step_runs_the_mosaic_kernel_on_hopper():
    """On a Hopper GPU the model's attention ("auto") is the Mosaic GPU kernel where it takes the
    head dim and dtype, also inside the scanned layers under remat, which splits the forward into
    what it saves and what it recomputes: the kernel's in-place buffers stay on one side."""
    argv = ["--config", "tiny", "--seq-len", "256", "rollout.max_new_tokens=16"]
    argv += ["model.dtype=bfloat16", "model.head_dim=64", "model.remat=dots"]
    text = train_step_text(argv, "data=1", "1x1")
    assert 'custom_call_target="mosaic_gpu' in text
    assert not re.search(r"jspec_attention_(fwd|dkdv|dq)\b", text)  # no Triton attention kernel
    assert "jspec_attention_mosaic_fwd" in text and "jspec_attention_mosaic_bwd" in text
