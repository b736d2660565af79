"""The measuring parts of `jspec/bench/rollout.py`: which prompts each batch runs (a queue of
distinct prompts), the speedup the costs predict, the draft's proposal loop for every kind of
draft, the naming of profiled kernels from an XLA dump
(`jspec/bench/kernel_profile.py`), and the greedy check of the rollout path (plain and a tree, even
with `--no-spec`) against a step-by-step loop (`jspec/bench/greedy_check.py`)."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.bench import greedy_check, kernel_census, kernel_profile
from jspec.bench import rollout as bench_rollout
from jspec.config import DraftConfig
from jspec.models import draft_factory

ARGS = argparse.Namespace(acceptance_rows=16, prompts_per_row=4, prompt_len=3)
HLO = """HloModule jit__generate
%fused_add (p: f32[8,128]) -> f32[8,128] {
  ROOT %add.1 = f32[8,128]{1,0} add(%p, %p)
}
ENTRY %main {
  %loop_add_fusion.7 = f32[8,128]{1,0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_generate)/while/body/jit(_trunk_kernel)/add"}
  ROOT %input_convert_reduce_fusion = (f32[8,4]{1,0}, bf16[8,576,4]{2,1,0}) fusion(%a, %b), kind=kInput, calls=%fused_convert_reduce, metadata={op_name="jit(_generate)/while/body/reduce_sum"}
}
"""  # noqa: E501


def test_each_batch_runs_a_queue_of_distinct_prompts_in_turn():
    rows = np.arange(20)[:, None] * np.ones((1, 3), int)  # prompt i: [i, i, i]
    one = bench_rollout.queue(rows, 1, ARGS)  # at least --acceptance-rows prompts
    assert one.shape == (16, 3) and one[:, 0].tolist() == list(range(16))
    wide = bench_rollout.queue(rows, 64, ARGS)  # --prompts-per-row: the distinct ones repeat
    assert wide.shape == (256, 3) and wide[:, 0].tolist() == [i % 20 for i in range(256)]
    assert bench_rollout.prompt_count(argparse.Namespace(**vars(ARGS), batches=[1, 8])) == 32


def test_the_predicted_speedup_counts_the_loop_work_both_loops_pay():
    rate = lambda step, accepted, busy: bench_rollout.LoopRate(step, 0.0, accepted, busy)
    plain = rate(step=2.0, accepted=1.0, busy=1.0)  # a 1.5 forward and 0.5 of the loop's work
    spec = rate(step=3.0, accepted=3.0, busy=0.8)  # verify + proposal 2.5, the same loop work
    # 3 x 0.8 tokens per 3.0 against 1 per 2.0: measured and predicted agree when costs add up
    assert np.isclose(bench_rollout.predicted_speedup(spec, plain, 2.5, forward=1.5), 1.6)
    # with no loop work (the bare forward is the plain step) the prediction is the cost curve's
    assert np.isclose(bench_rollout.predicted_speedup(spec, plain, 2.5, forward=2.0), 2.4 / 1.25)


@pytest.mark.parametrize("tied", [False, True])
def test_the_memory_floor_counts_the_weights_a_decode_step_reads(tied):
    """float32 parameters decoded in bfloat16: the floor counts the rollout copy's bytes (every
    layer's weights, the final norm and the head in bfloat16), not the parameters', and not the
    input embedding where the head is a matrix of its own (a step gathers its rows)."""
    import dataclasses

    from jspec.config import ModelConfig
    from jspec.models import create

    config = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=64, max_seq_len=64, dtype="bfloat16", param_dtype="float32",
    )  # fmt: skip
    model = create(dataclasses.replace(config, tie_embeddings=tied))
    rollout = model.for_rollout()
    read = [*rollout.unstacked, rollout.final_norm, rollout.embed if tied else rollout.unembed]
    want = sum(x.nbytes for x in jax.tree.leaves(nnx.state(nnx.List(read))))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(nnx.List(read)))} == {jnp.dtype("bfloat16")}
    assert bench_rollout.decode_weight_bytes(model) == want


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "block"])
def test_the_draft_loop_proposes_as_generate_does_for_every_kind_of_draft(kind):
    """The loop that times a draft's proposal runs each kind's (a block draft's chain comes from
    one forward, not tree steps); at temperature 0 every trip proposes the same tree (the root
    moves with the loop only to keep the proposal in it), of the target's token ids."""
    args = bench_rollout.parse_args(
        [*GREEDY_CHECK_ARGS.split(), "--new-tokens", "4", "--trees", "chain 4"]
    )
    target, _, prompts = bench_rollout.random_models(args, dtype="float32")
    draft = draft_factory.from_config(DraftConfig(kind=kind), target)
    prompts = jnp.asarray(prompts[:2])
    lengths = jnp.full((2,), args.prompt_len, jnp.int32)
    tree = bench_rollout.TREES["chain 4"]
    run = bench_rollout.draft_loop(target, draft, prompts, lengths, tree, 32, args)
    once, twice = np.asarray(run(jnp.int32(1))), np.asarray(run(jnp.int32(2)))
    np.testing.assert_array_equal(twice, 2 * once)
    assert ((once >= 0) & (once < target.config.vocab_size)).all()


def test_profiled_kernels_are_named_by_their_hlo(tmp_path, monkeypatch):
    (tmp_path / "module_0001.jit__generate.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0002.jit_run.sm_9.0a_gpu_after_optimizations.txt").write_text("")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_hlo_as_text --xla_dump_to={tmp_path}")
    kernels = ["loop_add_fusion_7", "input_convert_reduce_fusion", "nvjet_sm90_tst_128x8"]
    assert kernel_profile.hlo_ops(kernels) == {
        "loop_add_fusion_7": "f32[8,128]{1,0} jit(_trunk_kernel)/add",
        "input_convert_reduce_fusion": "(f32[8,4]{1,0}, bf16[8,576,4]{2,1,0}) reduce_sum",
    }
    monkeypatch.setenv("XLA_FLAGS", "")
    assert kernel_profile.hlo_ops(kernels) == {}


# 3 layers (3 taps): quick compiles. One tree, timed or not (`--no-spec`): the trees' greedy
# identity in general is `test_generate`'s.
GREEDY_CHECK_ARGS = "--device cpu --config tiny --prompt-len 12 model.num_layers=3 --no-spec"


LOOP_HLO = """HloModule jit_run
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add.3
  %b = (f32[8,4]{1,0}, f32[8]{0}) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  %c = (f32[8]{0}, bf16[8,2]{1,0}) fusion(%b), kind=kInput, calls=%fused_reduce.1
  %d = f32[8]{0} get-tuple-element(%c), index=0
}

ENTRY %main {
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""


def test_the_census_counts_every_kernel_of_a_loop_body_those_of_several_outputs_too():
    """`jspec/bench/kernel_census.py` reads the compiled program's text: a kernel of several
    outputs (a Pallas call's, a multi-output fusion) has a tuple type and counts as one kernel,
    written as large as its first output."""
    (body,) = kernel_census.loop_bodies(LOOP_HLO).values()
    assert [(k.op, k.name, k.elements) for k in body] == [
        ("fusion", "fused_add", 8),
        ("custom-call", "__gpu$xla.gpu.triton", 32),
        ("fusion", "fused_reduce", 8),
    ]


def test_the_census_lists_one_layer_of_the_target_in_order():
    """Three layers, the first with a kernel hoisted into it and the step's own kernels around
    them: one layer is the span the once-a-layer kernel starts, without the hoisted one, with a
    kernel XLA left unnamed (a split-K product's)."""
    k = lambda name, part="target_forward": kernel_census.Kernel("fusion", name, 8, f"{part}/x")
    layer = [k("qkv"), k("attend"), kernel_census.Kernel("fusion", "gemm", 8, ""), k("mlp")]
    step = [k("draw", "draft_tree"), k("hoisted"), *layer * 3, k("accept", "verify")]
    assert kernel_census.one_layer(step, 3) == layer
    assert kernel_census.one_layer(step[1:6], 1) == [step[1], *layer[:2], layer[3]]  # the forward
    assert "one layer of the target, in order:\n  fusion       qkv " in kernel_census.table(step, 3)
    unnamed = kernel_census.Kernel("custom-call", "topk", 8, "")
    assert kernel_census.parts([unnamed, step[0], unnamed, *layer]) == [
        *("other", "draft_tree", "draft_tree"),
        *("target_forward",) * 4,  # the split-K product's too
    ]


def test_the_greedy_check_passes_the_rollout_path_and_fails_a_changed_token(monkeypatch, capsys):
    args = bench_rollout.parse_args([*GREEDY_CHECK_ARGS.split(), "--trees", "chain 4"])
    models = bench_rollout.random_models(args, dtype="float32")
    trees = {name: bench_rollout.TREES[name] for name in args.trees}  # as main passes them
    step_by_step, recorded = greedy_check.step_by_step_greedy, []
    monkeypatch.setattr(
        greedy_check,
        "step_by_step_greedy",
        lambda *a: recorded.append(step_by_step(*a)) or recorded[-1],
    )
    greedy_check.check_greedy(*models, trees, args, batch=2, new_tokens=6)
    assert "greedy check: chain 4 equal" in capsys.readouterr().out

    changed = recorded[0].copy()
    changed[1, 3] += 1  # the plain loop, compiled above, runs again against one changed token
    monkeypatch.setattr(greedy_check, "step_by_step_greedy", lambda *a: changed)
    with pytest.raises(SystemExit, match="plain differs"):
        greedy_check.check_greedy(*models, trees, args, batch=2, new_tokens=6)


def test_every_speedup_is_quoted_with_its_temperature_trees_and_draft(tmp_path):
    """The default trees follow --temperature (sampled above 0, argmax at 0); the JSON and the
    log say the temperature and where the draft came from."""
    args = bench_rollout.parse_args(["--temperature", "1"])
    assert args.trees == ["sampled chain 4", "sampled dynamic 8"]
    assert bench_rollout.parse_args([]).trees == ["chain 4", "dynamic 8 (SGLang)"]
    random_draft = {"temperature": 1.0, "draft": "random weights: speed only"}
    assert bench_rollout.provenance(args) == random_draft
    report = {"args": {"draft_steps": 3000}, "draft_top1_agreement": 0.7712}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "draft").mkdir()  # where train_code_lm writes its EAGLE-3 draft
    trained = bench_rollout.provenance(bench_rollout.parse_args(["--trained", str(tmp_path)]))
    assert trained["temperature"] == 0.0 and trained["draft"].startswith("trained offline")
    assert (trained["draft_steps"], trained["draft_top1_agreement"]) == (3000, 0.771)
