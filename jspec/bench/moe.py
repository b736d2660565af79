"""Benchmark of one mixture-of-experts decoder layer against a dense layer of the same active size.

    python -m jspec.bench.moe --device cpu      # tiny shapes, 8 virtual CPU devices
    python -m jspec.bench.moe --device gpu      # Qwen3-30B-A3B layer; --ep 1 2 on two

One decoder layer (`jspec.models.transformer.Block`: attention and MLP, as the model runs it) of
`--config` (default: Qwen3-30B-A3B on gpu, the tiny test model with 8 experts on cpu), and the same
layer with a dense SwiGLU MLP of width num_experts_per_tok * moe_intermediate_size (the same active
MLP parameters per token). For each it times
- train: forward+backward (gradients of the input and of every weight) on `--batch` rows of
  `--seq` tokens per device, reported as tokens/s per device and achieved TFLOP/s (matmul FLOPs of
  the active parameters and causal attention; backward = 2x forward) against `--peak-tflops`;
- decode: the forward of `--decode-batch` rows of one token (no KV cache: the layer's weight
  traffic, which dominates decode), reported as bytes/s of the weights it must read (attention,
  router, and the experts a batch of that size reaches under uniform routing, X (1 - (1 - K/X)^B))
  against `--peak-bytes`.
With `--ep 2`, the MoE layer also runs with its experts split over 2 devices (the mesh's data axis,
the token exchange inside `shard_map`) at the same tokens per device, and its output is compared
with one device's on the same batch (`ep_rel_err`). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jspec import mesh as mesh_lib
from jspec.jobs import cli

CPU_DEFAULTS = (
    "tiny",
    ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"],
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--config", default=None, help="model config (default: see above)")
    p.add_argument("--set", nargs="*", default=None, help="dotted overrides, model.x=y")
    p.add_argument("--batch", type=cli.at_least(1), default=None, help="train rows per device")
    p.add_argument("--seq", type=cli.at_least(1), default=None, help="train tokens per row")
    p.add_argument(
        "--decode-batch", type=cli.at_least(1), default=None, help="decode rows per device"
    )
    p.add_argument(
        "--ep", type=cli.at_least(1), nargs="+", default=[1, 2], help="expert-parallel sizes"
    )
    p.add_argument(
        "--peak-tflops", type=cli.positive, default=801.0, help="H200 bf16 matmul (docs/gpu.md)"
    )
    p.add_argument(
        "--peak-bytes", type=cli.positive, default=4.1e12, help="H200 copy bandwidth (docs/gpu.md)"
    )
    p.add_argument("--iters", type=cli.at_least(1), default=5)
    p.add_argument("--json", default="bench_moe.json")
    args = p.parse_args(argv)
    gpu = args.device == "gpu"
    args.config = args.config or ("qwen3-30b-a3b" if gpu else CPU_DEFAULTS[0])
    args.set = args.set if args.set is not None else ([] if gpu else CPU_DEFAULTS[1])
    args.batch = args.batch or (4 if gpu else 2)
    args.seq = args.seq or (4096 if gpu else 64)
    args.decode_batch = args.decode_batch or (64 if gpu else 8)
    return args


def layer_fn(config, mesh):
    """(state, forward(state, x) -> y) of one layer, its weights placed on `mesh`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jspec.attention import attention
    from jspec.models.layers import rope_angles
    from jspec.models.transformer import TRAIN_ACT, Block, param_shardings

    block = Block(config, 1, rngs=nnx.Rngs(0), sparse=bool(config.num_experts), mesh=mesh)
    graphdef, state = nnx.split(block)
    if mesh is not None:
        state = jax.device_put(state, param_shardings(state, mesh))

    def forward(state, x_BTD):
        b, t = x_BTD.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        seg = jnp.ones((b, t), jnp.int32)
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
        attend = lambda q, k_, v: attention(q, k_, v, seg, pos)  # noqa: E731
        return layer(x_BTD, rope_angles(config, pos), attend, TRAIN_ACT, seg > 0)[0]

    return state, forward


def train_step(forward):
    """Gradients of a squared-output loss with respect to weights and input."""
    import jax
    import jax.numpy as jnp

    loss = lambda s, x: jnp.sum(forward(s, x).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))


def check_grouped_matmul(a: int = 4096, g: int = 16, k: int = 2048, n: int = 768) -> None:
    """The Mosaic grouped matmul (value, input and weight gradients, bf16) against the same custom
    VJP on `lax.ragged_dot` products; exits if they differ by more than bf16 rounding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.models.grouped_matmul import LAX, MOSAIC, grouped_matmul, use_mosaic

    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(a - 100, np.ones(g) / g), jnp.int32)  # 100 rows past
    x, w, dy = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((a, k), (g, k, n), (a, n)))
    if not use_mosaic(x, w):
        raise SystemExit(
            f"the grouped matmul does not take the Mosaic kernels on {jax.devices()[0]}"
        )

    def grads(kernels):
        f = lambda x, w: grouped_matmul(x, w, sizes, kernels=kernels)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return [t.astype(jnp.float32) for t in (y, *vjp(dy))]

    got, want = jax.jit(lambda: grads(MOSAIC))(), jax.jit(lambda: grads(LAX))()
    error = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
    errors = [error(a, b) for a, b in zip(got, want, strict=True)]
    print(
        "grouped matmul, Mosaic vs lax (y, dx, dw), max error / max:",
        ", ".join(f"{e:.1e}" for e in errors),
        flush=True,
    )
    if max(errors) > 2e-2:
        raise SystemExit("the Mosaic grouped matmul differs from lax.ragged_dot")


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        mesh_lib.use_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec import config as config_lib
    from jspec.bench.timing import time_compiled
    from jspec.config import MeshConfig
    from jspec.mesh import make_mesh, sharding

    if args.device == "gpu":
        check_grouped_matmul()
    devices = jax.devices()
    c = config_lib.load(args.config, args.set).model
    c = dataclasses.replace(c, num_layers=1, tap_layers=(0,), remat="none")
    c.validate()
    if not c.num_experts:
        raise SystemExit(f"--config {args.config} has no experts (model.num_experts=0).")
    dense = dataclasses.replace(
        c, num_experts=0, intermediate_size=c.num_experts_per_tok * c.moe_intermediate_size
    )
    dtype = jnp.dtype(c.dtype)
    d = c.hidden_size

    rng = np.random.default_rng(0)
    most = max([p for p in args.ep if p <= len(devices)] + [1])
    inputs = {  # per device count p the first p * rows: the same tokens lead every run
        "train": jnp.asarray(rng.normal(size=(args.batch * most, args.seq, d)), dtype),
        "decode": jnp.asarray(rng.normal(size=(args.decode_batch * most, 1, d)), dtype),
    }
    rows, one_device = [], None

    def save():  # after every row, so a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "device": devices[0].device_kind, "rows": rows}, f, indent=1
            )

    cases = [("dense", dense, 1)] + [("moe", c, p) for p in args.ep if p <= len(devices)]
    for name, config, p in cases:
        mesh = None if p == 1 else make_mesh(MeshConfig(data=p), devices[:p])
        state, forward = layer_fn(config, mesh)
        for mode, b, t in (("train", args.batch, args.seq), ("decode", args.decode_batch, 1)):
            x = inputs[mode][: b * p]
            if mesh is not None:
                x = jax.device_put(x, sharding(mesh, ("batch", None, None)))
            fn = train_step(forward) if mode == "train" else forward
            ms, _, _, out = time_compiled(fn, (state, x), args.iters)
            tokens = b * t  # per device
            row = {
                "layer": name,
                "devices": p,
                "mode": mode,
                "rows_per_device": b,
                "seq": t,
                "ms": ms,
                "tokens_per_s_per_device": tokens / ms * 1e3,
            }
            row.update(rates(row, c, args))
            if mode == "decode":
                if name == "moe" and p == 1:
                    one_device = np.asarray(out, np.float32)
                elif name == "moe" and one_device is not None:  # its first rows: one device's
                    y = np.asarray(jax.device_get(out), np.float32)[: one_device.shape[0]]
                    err = np.abs(y - one_device).max() / np.abs(one_device).max()
                    row["ep_rel_err"] = float(err)
            rows.append(row)
            print(row, flush=True)
            save()

    print_table(rows, args, c, dense, devices[0].device_kind)
    print(f"wrote {args.json}")


def rates(row, c, args) -> dict:
    """Achieved TFLOP/s (train) or weight bytes/s (decode) of a measured row, and their share of
    the peak. Active parameters: attention and the experts a token (train) or the batch (decode,
    under uniform routing) reaches."""
    d, h, e = c.hidden_size, c.num_heads, c.head_dim
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[c.param_dtype]  # jax not imported here
    attn_params = d * (h + 2 * c.num_kv_heads) * e + h * e * d
    mlp_active = 3 * d * c.num_experts_per_tok * c.moe_intermediate_size
    b, t, ms = row["rows_per_device"], row["seq"], row["ms"]
    if row["mode"] == "train":
        flops = 2 * b * t * (attn_params + mlp_active) + 4 * b * t * t / 2 * h * e
        tflops = 3 * flops / (ms * 1e9)
        return {"tflops_per_device": tflops, "of_peak": tflops / args.peak_tflops}
    out = {}
    weights = (attn_params + mlp_active) * itemsize
    if row["layer"] == "moe":
        x, k = c.num_experts, c.num_experts_per_tok
        out["experts_reached"] = x * (1 - (1 - k / x) ** b)
        expert_bytes = 3 * d * c.moe_intermediate_size * itemsize
        weights = (attn_params + d * x) * itemsize + out["experts_reached"] * expert_bytes
    out["weight_bytes_per_s"] = weights / (ms * 1e-3)
    out["of_peak"] = out["weight_bytes_per_s"] / args.peak_bytes
    return out


def print_table(rows, args, c, dense, device_kind) -> None:
    """The measured rows as a table, then MoE over dense tokens/s on one device."""
    print(
        f"\none {args.config} layer, {args.device} ({device_kind}), {c.dtype}: "
        f"D={c.hidden_size}, {c.num_experts} experts top-{c.num_experts_per_tok} of width "
        f"{c.moe_intermediate_size} vs dense width {dense.intermediate_size}; train "
        f"{args.batch}x{args.seq} tokens/device, decode {args.decode_batch} rows/device"
    )
    print(
        f"{'layer':>6} {'dev':>4} {'mode':>7} {'ms':>9} {'tokens/s/dev':>13} "
        f"{'TFLOP/s':>8} {'GB/s':>8} {'of peak':>8}"
    )
    for r in rows:
        tf = f"{r['tflops_per_device']:8.1f}" if "tflops_per_device" in r else f"{'':>8}"
        gb = f"{r['weight_bytes_per_s'] / 1e9:8.1f}" if "weight_bytes_per_s" in r else f"{'':>8}"
        print(
            f"{r['layer']:>6} {r['devices']:>4} {r['mode']:>7} {r['ms']:9.2f} "
            f"{r['tokens_per_s_per_device']:13.0f} {tf} {gb} {r['of_peak']:8.1%}"
        )
    by = {(r["layer"], r["devices"], r["mode"]): r for r in rows}
    for mode in ("train", "decode"):
        if ("moe", 1, mode) in by:
            ratio = (
                by["moe", 1, mode]["tokens_per_s_per_device"]
                / by["dense", 1, mode]["tokens_per_s_per_device"]
            )
            print(f"{mode}: MoE / dense tokens/s on one device = {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
