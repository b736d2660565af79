"""Benchmark of jspec.attention: time and memory of context parallelism, ring vs all-gather.

    python -m jspec.bench.attention --device cpu --mean-doc 2048   # 8 virtual CPU devices
    python -m jspec.bench.attention --device gpu --cp 1 2 --scaling weak --seq 131072 \
        --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --branch-steps 6

For each method (the zigzag ring; the all-gather baseline, which gathers K/V over the context axis
and attends with the same local kernel, autodiff saving what it saves), each cp and each stack depth
it times the forward and the forward+backward on packed rows, optionally with a training-time-test
branch step, and reads the compiled per-device temporary memory (peak beyond inputs and outputs).
Inputs are already in the ring's layout and split over the devices, so only attention is measured.
TFLOP/s count visible pairs only (backward = 2.5 forwards).

Rows are packed with documents from one length distribution (mean --mean-doc tokens, multiples of
ALIGN tokens so every cp up to 8 can shard them), whatever --seq and cp, so a series does the same
work per token. Without --scaling every cp runs rows of --seq tokens. A scaling series is one run:
--scaling weak gives each cp rows of --seq * cp tokens (--seq tokens per GPU), --scaling strong rows
of --seq tokens (split over cp); its efficiency is the per-GPU rate over that of cp=1 in the same
series (same method and depth). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from jspec import mesh as mesh_lib
from jspec.jobs import cli

# Document lengths are multiples of this: 2 * cp chunks of a multiple of 64 tokens for every cp
# up to 8, so one packing serves every row of a series.
ALIGN = 2 * 8 * 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument(
        "--cp", type=cli.at_least(1), nargs="+", default=None, help="ring sizes (default 1 2 4 8)"
    )
    p.add_argument(
        "--seq", type=cli.at_least(1), default=4096, help="tokens per row (--scaling weak: per GPU)"
    )
    p.add_argument("--scaling", choices=("weak", "strong"), default=None, help="a scaling series")
    p.add_argument(
        "--mean-doc", type=cli.at_least(1), default=16384, help="mean document length (tokens)"
    )
    p.add_argument("--batch", type=cli.at_least(1), default=1)
    p.add_argument("--heads", type=cli.at_least(1), default=8)
    p.add_argument("--kv-heads", type=cli.at_least(1), default=2)
    p.add_argument("--head-dim", type=cli.at_least(1), default=64)
    p.add_argument(
        "--block", type=cli.at_least(1), default=None, help="tile size (default: the library's)"
    )
    p.add_argument(
        "--branch-steps", type=cli.at_least(0), default=0, help="TTT step of the branch (0: none)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--layers", type=cli.at_least(1), nargs="+", default=[1], help="stack depths to measure"
    )
    p.add_argument(
        "--methods", nargs="+", choices=("ring", "allgather"), default=["ring", "allgather"]
    )
    p.add_argument("--impl", default="auto", help="local kernel: auto | xla | pallas")
    p.add_argument("--iters", type=cli.at_least(1), default=3)
    p.add_argument("--json", default="bench_attention.json")
    return p.parse_args(argv)


AUTO_KERNELS = ("auto", "pallas", "xla")


def restrict_auto(kernel: str) -> None:
    """Make attention's impl="auto" (what the models call) take `kernel` on a GPU: "pallas" passes
    over the Mosaic GPU kernel for the Triton one, "xla" over both for the XLA blocks, "auto"
    changes nothing. For benchmarks comparing the kernels inside a whole model."""
    from jspec.attention import mosaic_gpu, pallas_gpu

    if kernel in ("pallas", "xla"):
        mosaic_gpu.available = lambda: False
    if kernel == "xla":
        pallas_gpu.available = lambda: False


def packed_rows(batch, seq, mean_doc, unit, rng):
    """(segment ids, positions) [batch, seq] of rows packed with documents from one distribution.

    Lengths are unit * k with k uniform on 1 .. 2 * mean_doc / unit - 1 (mean `mean_doc`), the last
    document of a row cut at the row end. The distribution does not depend on `seq`, so rows of
    different lengths (a weak-scaling series) do the same attention work per token; only the cut
    documents differ. `seq` must be a multiple of `unit`, so every document is.
    """
    import numpy as np

    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    most = 2 * mean_doc // unit - 1
    for row in range(batch):
        start, doc = 0, 1
        while start < seq:
            length = min(unit * int(rng.integers(1, most + 1)), seq - start)
            seg[row, start : start + length] = doc
            pos[row, start : start + length] = np.arange(length)
            start, doc = start + length, doc + 1
    return seg, pos


def visible_pairs(seg, pos, steps) -> int:
    """(query, key) pairs attended: every trunk token sees its document up to itself; a branch
    query at step s sees the same trunk keys as its anchor, plus its s nodes."""
    trunk = int(((pos + 1) * (seg > 0)).sum())
    return trunk * (2 if steps else 1) + seg.size * steps


def series_rows(args, n_devices) -> list[tuple[int, int]]:
    """(cp, tokens per row) of each row, in order; exits at once on a row this run cannot do."""
    cps = sorted(args.cp or [c for c in (1, 2, 4, 8) if c <= n_devices])
    if max(cps) > n_devices:
        sys.exit(f"--cp {max(cps)} needs {max(cps)} {args.device} devices; {n_devices} found.")
    if any(ALIGN % (2 * c) for c in cps):
        sys.exit(f"--cp {cps}: documents are aligned to {ALIGN} tokens; cp must divide 8.")
    if args.scaling and cps[0] != 1:
        sys.exit(f"--scaling {args.scaling} needs cp 1 in --cp (the reference of the efficiency).")
    if args.mean_doc % ALIGN or args.seq % ALIGN or min(args.mean_doc, args.seq) <= 0:
        sys.exit(f"--mean-doc and --seq must be multiples of {ALIGN} tokens (the document unit).")
    return [(c, args.seq * c if args.scaling == "weak" else args.seq) for c in cps]


def devices_for(args):
    """The devices to run on; exits at once if `--device gpu` finds no GPU."""
    import jax

    devices = jax.devices()
    if args.device == "gpu" and devices[0].platform != "gpu":
        sys.exit(f"--device gpu: JAX sees no GPU here (only {devices[0].platform} devices).")
    return devices


def make_inputs(args, seq):
    """Natural-order (q, k, v, seg, pos, branch or None) of `batch` rows of `seq` tokens, and their
    visible pairs. Seeded alike for every row length, so a strong-scaling series times the same rows
    at every cp and a weak one starts each row with the same documents."""
    import jax.numpy as jnp
    import numpy as np

    from jspec.attention import Branch

    rng = np.random.default_rng(0)
    b, t, steps = args.batch, seq, args.branch_steps
    seg, pos = packed_rows(b, t, args.mean_doc, ALIGN, rng)

    def normal(n, heads):
        x = rng.standard_normal((b, n, heads, args.head_dim), np.float32)
        return jnp.asarray(x, args.dtype)

    q, k, v = normal(t, args.heads), normal(t, args.kv_heads), normal(t, args.kv_heads)
    branch = None
    if steps:
        n = t * steps  # nodes of steps 1..steps, step s anchored like step s - 1
        node = jnp.arange(n)
        anchor = jnp.broadcast_to(node % t, (b, n))
        parent = jnp.broadcast_to(jnp.where(node >= t, node - t, -1), (b, n))
        query_nodes = jnp.broadcast_to((steps - 1) * t + jnp.arange(t), (b, t))
        bq, bk, bv = normal(t, args.heads), normal(n, args.kv_heads), normal(n, args.kv_heads)
        branch = Branch(bq, bk, bv, anchor, parent, query_nodes)
    return (q, k, v, jnp.asarray(seg), jnp.asarray(pos), branch), visible_pairs(seg, pos, steps)


def shard_inputs(inputs, mesh, cp):
    """The inputs in the ring's layout, already split over `mesh`: only attention is timed."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jspec.attention import zigzag_shard
    from jspec.attention.parallel import place_branch

    *arrays, seg, pos, branch = inputs
    placed = [zigzag_shard(x, seg, cp) for x in (*arrays, seg, pos)]
    placed.append(None if branch is None else place_branch(branch, seg, cp)[0])
    return jax.device_put(placed, NamedSharding(mesh, P(None, "context")))


def allgather_attention(mesh, kernel):
    """The baseline: every rank gathers all K/V of the row, then attends locally."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jspec.attention import attention

    def local(q, k, v, seg, pos, branch):
        gather = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)
        offset = jax.lax.axis_index("context") * k.shape[1]
        if branch is not None:
            anchor = jnp.where(branch.anchor >= 0, branch.anchor + offset, -1)
            branch = branch._replace(anchor=anchor)
        out = attention(
            q,
            gather(k),
            gather(v),
            gather(seg),
            gather(pos),
            q_segment_ids=seg,
            q_positions=pos,
            branch=branch,
            **kernel,
        )
        return out if branch is not None else (out, None)

    def run(q, k, v, seg, pos, branch):
        spec = P(None, "context")
        out_specs = (spec, None if branch is None else spec)
        return jax.shard_map(
            local, mesh=mesh, in_specs=(spec,) * 6, out_specs=out_specs, check_vma=False
        )(q, k, v, seg, pos, branch)

    return run


def stacked_loss(attend, layers):
    """`layers` attention calls in a chain (each layer's inputs depend on the last output), so a
    deeper stack shows what autodiff keeps alive across layers."""
    import jax.numpy as jnp

    def loss(q, k, v, seg, pos, branch):
        total = 0.0
        for _ in range(layers):
            out, branch_out = attend(q, k, v, seg, pos, branch)
            total += jnp.sum(out.astype(jnp.float32) ** 2)
            kv = out.reshape(*k.shape[:3], -1, k.shape[3]).mean(axis=3).astype(k.dtype)
            q, k, v = q + out, k + kv, v + kv
            if branch is not None:
                total += jnp.sum(branch_out.astype(jnp.float32) ** 2)
                branch = branch._replace(q=branch.q + branch_out)
        return total

    return loss


def fwd_bwd_of(loss):
    """Gradients of `loss` w.r.t. q, k, v and the branch's float leaves."""
    import jax

    def fwd_bwd(*xs):
        grads = jax.grad(loss, argnums=(0, 1, 2, 5), allow_int=True)(*xs)
        return [g for g in jax.tree.leaves(grads) if g.dtype != jax.dtypes.float0]

    return fwd_bwd


def time_row(attend, layers, inputs, iters, flops_fwd, cp):
    """Times, per-GPU TFLOP/s and temporary memory of the forward and the forward+backward."""
    from jspec.bench.timing import time_compiled

    loss = stacked_loss(attend, layers)
    row = {}
    for name, fn in (("fwd", loss), ("fwd_bwd", fwd_bwd_of(loss))):
        timed = time_compiled(fn, inputs, iters)
        ms, temp_mib = timed.ms, timed.compiled.memory_analysis().temp_size_in_bytes / 2**20
        flops = flops_fwd * layers * (1 if name == "fwd" else 3.5)  # bwd = 2.5 fwd
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops_per_gpu"] = flops / cp / (ms * 1e9)
        row[f"{name}_temp_mib"] = temp_mib
    return row


def add_efficiency(row, rows):
    """The per-GPU rate of `row` over that of cp=1 in the same series (same method and depth)."""
    key = lambda r: (r["method"], r["layers"])
    ref = [r for r in (*rows, row) if r["cp"] == 1 and key(r) == key(row)]
    for name in ("fwd", "fwd_bwd"):
        rate = f"{name}_tflops_per_gpu"
        row[f"{name}_efficiency"] = row[rate] / ref[0][rate] if ref else None


def print_table(rows, args, device_kind):
    """The run's rows as one table, its shapes and document distribution in the title."""
    steps, series = args.branch_steps, args.scaling or "none"
    print(
        f"jspec.attention context parallelism, {args.device} ({device_kind}), B={args.batch}, "
        f"H={args.heads}/{args.kv_heads}, D={args.head_dim}, {args.dtype}, branch step {steps}, "
        f"mean document {args.mean_doc}, scaling {series}"
    )
    print(
        f"{'method':>9} {'cp':>3} {'layers':>6} {'seq':>7} {'tok/GPU':>7} {'fwd ms':>9} "
        f"{'fwd+bwd ms':>11} {'fwd temp MiB':>13} {'fwd+bwd temp MiB':>17} "
        f"{'TFLOP/s/GPU fwd+bwd':>20} {'eff':>5}"
    )
    for r in rows:
        eff = r.get("fwd_bwd_efficiency")
        print(
            f"{r['method']:>9} {r['cp']:>3} {r['layers']:>6} {r['seq']:>7} "
            f"{r['tokens_per_gpu']:>7} {r['fwd_ms']:>9.1f} {r['fwd_bwd_ms']:>11.1f} "
            f"{r['fwd_temp_mib']:>13.1f} {r['fwd_bwd_temp_mib']:>17.1f} "
            f"{r['fwd_bwd_tflops_per_gpu']:>20.1f} {'-' if eff is None else f'{eff:.2f}':>5}"
        )


def run_cp(args, devices, cp, inputs, pairs, rows):
    """Appends the rows of one cp (every method and depth) to `rows`, writing the JSON after each,
    so a run cut short keeps what it measured."""
    import jax

    from jspec.attention.parallel import sharded_ring

    seq = inputs[3].shape[1]
    flops_fwd = 4 * pairs * args.heads * args.head_dim  # per layer
    mesh = jax.make_mesh(
        (cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:cp]
    )
    placed = shard_inputs(inputs, mesh, cp)
    kernel = dict(impl=args.impl, block_q=args.block, block_k=args.block)
    methods = {"ring": sharded_ring(mesh, "context", **kernel)}
    methods["allgather"] = allgather_attention(mesh, kernel)
    for method in args.methods:
        for layers in args.layers:
            row = {"method": method, "cp": cp, "layers": layers, "seq": seq}
            row["tokens_per_gpu"] = seq // cp
            row["visible_pairs_per_token"] = pairs / (args.batch * seq)
            row.update(time_row(methods[method], layers, placed, args.iters, flops_fwd, cp))
            if args.scaling:
                add_efficiency(row, rows)
            rows.append(row)
            print(row, flush=True)
            with open(args.json, "w") as f:
                out = {"args": vars(args), "device": devices[0].device_kind, "rows": rows}
                json.dump(out, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        mesh_lib.use_cpu_devices(8)
    devices = devices_for(args)
    rows, made = [], {}
    for cp, seq in series_rows(args, len(devices)):
        if seq not in made:  # one set of rows per length: a strong series reuses it at every cp
            made.clear()  # before making the next, so only one set is ever alive
            made[seq] = make_inputs(args, seq)
        run_cp(args, devices, cp, *made[seq], rows)
    print_table(rows, args, devices[0].device_kind)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
