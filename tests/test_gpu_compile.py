"""What XLA's GPU compiler makes of the rollout, compiled on this CPU for an H200 from its
description (`jspec.bench.kernel_census`, as `jspec.jobs.plan --gpu-target` compiles): the
decode loop's kernels, where a layer's weights are read once and never written. Needs jax's
CUDA plugin (`pip install -e '.[gpu]'`, there on the GPU machines); without it the tests skip
and say so."""

import pytest

from jspec.bench import kernel_census
from jspec.jobs import plan_devices

pytestmark = pytest.mark.skipif(
    not plan_devices.has_cuda_plugin(),
    reason="jax's CUDA plugin (XLA's GPU compiler) is not installed: pip install -e '.[gpu]'",
)
# Small enough that XLA's GPU compiler turns each of a decode step's products into a reduction
# (it does so up to about 8M weights), large enough that a weight outweighs every activation.
MODEL = ["model.hidden_size=512", "model.num_heads=4", "model.num_kv_heads=2"]
MODEL += ["model.head_dim=128", "model.intermediate_size=1024", "model.num_layers=2"]
HIDDEN, WIDTH, MLP = 512, 4 * 128, 1024


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_writes_no_weight_sized_array(batch, tmp_path):
    """Every product of a decode step reads its weight once: no kernel of the loop writes an
    array as large as the smallest weight (the attention output's, H*E x D), as XLA's GPU
    compiler does for a matrix-vector product over a small weight stored inputs first."""
    argv = ["--config", "tiny", "--batch", str(batch), "--prompt", "48", "--new", "16", *MODEL]
    args = kernel_census.parse_args([*argv, "--out", str(tmp_path / "census.json")])
    compiled, cfg = kernel_census.compile_rollout(args)
    kernels = kernel_census.decode_loop(kernel_census.loop_bodies(compiled.as_text()))
    assert len(kernels) > 10 * cfg.model.num_layers, kernels  # the decode loop's body
    largest = max(kernels, key=lambda k: k.elements)
    assert largest.elements < min(WIDTH * HIDDEN, HIDDEN * MLP), largest


def test_the_census_prints_its_table(capsys, tmp_path):
    out = tmp_path / "census.json"
    kernel_census.main(["--config", "tiny", "--prompt", "48", "--new", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("tiny, batch 1, plain decoding, for h200:\n")
    assert "a layer:" in printed and "writes of 1,048,576 elements or more: none" in printed
    assert out.exists()
