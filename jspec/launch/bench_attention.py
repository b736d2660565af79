"""Benchmark of jspec.attention: time and memory of context parallelism, ring vs all-gather.

    python -m jspec.launch.bench_attention --device cpu               # 8 virtual CPU devices
    python -m jspec.launch.bench_attention --device gpu --cp 2 --seq 262144 --heads 32 \
        --kv-heads 8 --head-dim 128 --dtype bfloat16 --branch-steps 6 --layers 1 4

For each method (the zigzag ring; the all-gather baseline, which gathers K/V over the context axis
and attends with the same local kernel, autodiff saving what it saves), each cp and each stack depth
it times the forward and the forward+backward on packed rows (documents of random lengths),
optionally with a training-time-test branch step, and reads the compiled per-device temporary
memory (peak beyond inputs and outputs). Inputs are already in the ring's layout and split over the
devices, so only attention is measured. TFLOP/s count visible pairs only (backward = 2.5 forwards).
Ring efficiency: the per-GPU rate at cp over the rate at cp=1 with seq/cp tokens (a second run).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--cp", type=int, nargs="+", default=None, help="ring sizes (default 1 2 4 8)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per row")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=None, help="tile size (default: the library's)")
    p.add_argument("--branch-steps", type=int, default=0, help="TTT step of the branch (0: none)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--layers", type=int, nargs="+", default=[1], help="stack depths to measure")
    p.add_argument(
        "--methods", nargs="+", choices=("ring", "allgather"), default=["ring", "allgather"]
    )
    p.add_argument("--impl", default="auto", help="local kernel: auto | xla | pallas")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default="bench_attention.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jspec.attention import Branch, attention, zigzag_shard
    from jspec.attention.parallel import place_branch, sharded_ring

    devices = jax.devices()
    cps = args.cp or [c for c in (1, 2, 4, 8) if c <= len(devices)]
    bad = [c for c in cps if c > len(devices) or args.seq % (2 * c)]
    if bad:
        sys.exit(
            f"--cp {bad}: each cp needs cp <= {len(devices)} devices and --seq divisible by 2*cp."
        )
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq

    # Packed rows: documents of random lengths, multiples of 2 * max(cp) * 64.
    unit = 2 * max(cps) * 64
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for row in range(b):
        start, doc = 0, 1
        while start < t:
            length = min(unit * int(rng.integers(1, max(2, t // unit // 2))), t - start)
            seg[row, start : start + length] = doc
            pos[row, start : start + length] = np.arange(length)
            start, doc = start + length, doc + 1
    # Visible (query, key) pairs: every trunk token sees its document up to itself; a branch
    # query at step s sees the same trunk keys as its anchor, plus its s nodes.
    pairs = int(((pos + 1) * (seg > 0)).sum()) * (2 if args.branch_steps else 1)
    pairs += b * t * args.branch_steps
    flops_fwd = 4 * pairs * args.heads * args.head_dim  # per layer
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q = normal(b, t, args.heads, args.head_dim)
    k, v = normal(b, t, args.kv_heads, args.head_dim), normal(b, t, args.kv_heads, args.head_dim)
    steps = args.branch_steps
    if steps:
        n = t * steps
        node = jnp.arange(n)
        anchor = jnp.broadcast_to(node % t, (b, n))
        parent = jnp.broadcast_to(jnp.where(node >= t, node - t, -1), (b, n))
        query_nodes = jnp.broadcast_to((steps - 1) * t + jnp.arange(t), (b, t))
        bq = normal(b, t, args.heads, args.head_dim)
        bk, bv = (
            normal(b, n, args.kv_heads, args.head_dim),
            normal(b, n, args.kv_heads, args.head_dim),
        )

    kernel = dict(impl=args.impl, block_q=args.block, block_k=args.block)

    def save(rows):  # after every row, so a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "device": devices[0].device_kind, "rows": rows}, f, indent=1
            )

    def allgather_attention(mesh):
        """The baseline: every rank gathers all K/V of the row, then attends locally."""

        def local(q, k, v, seg, pos, branch):
            gather = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)  # noqa: E731
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
        """`layers` attention calls in a chain (each layer's inputs depend on the last output)."""

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

    rows = []
    for cp in cps:
        mesh = jax.make_mesh(
            (cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:cp]
        )
        split = jax.sharding.NamedSharding(mesh, P(None, "context"))
        # Inputs in the ring's layout, already split: the benchmark times attention alone.
        inputs = [zigzag_shard(x, seg, cp) for x in (q, k, v, seg, pos)]
        if steps:
            inputs.append(place_branch(Branch(bq, bk, bv, anchor, parent, query_nodes), seg, cp)[0])
        else:
            inputs.append(None)
        inputs = jax.device_put(inputs, split)
        methods = {
            "ring": sharded_ring(mesh, "context", **kernel),
            "allgather": allgather_attention(mesh),
        }
        for method in args.methods:
            for layers in args.layers:
                loss = stacked_loss(methods[method], layers)

                def fwd_bwd(*xs, loss=loss):
                    grads = jax.grad(loss, argnums=(0, 1, 2, 5), allow_int=True)(*xs)
                    return [g for g in jax.tree.leaves(grads) if g.dtype != jax.dtypes.float0]

                row = {"method": method, "cp": cp, "layers": layers, "seq": t}
                for name, fn in (("fwd", loss), ("fwd_bwd", fwd_bwd)):
                    compiled = jax.jit(fn).lower(*inputs).compile()
                    jax.block_until_ready(compiled(*inputs))
                    start = time.perf_counter()
                    for _ in range(args.iters):
                        jax.block_until_ready(compiled(*inputs))
                    row[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / args.iters
                    flops = flops_fwd * layers * (1 if name == "fwd" else 3.5)  # bwd = 2.5 fwd
                    row[f"{name}_tflops_per_gpu"] = flops / cp / (row[f"{name}_ms"] * 1e9)
                    row[f"{name}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
                rows.append(row)
                print(row, flush=True)
                save(rows)

    head = (
        f"{'method':>9} {'cp':>3} {'layers':>6} {'seq':>7} {'fwd ms':>9} {'fwd+bwd ms':>11} "
        f"{'fwd temp MiB':>13} {'fwd+bwd temp MiB':>17} {'TFLOP/s/GPU fwd+bwd':>20}"
    )
    print(
        f"jspec.attention context parallelism, {args.device} ({devices[0].device_kind}), B={b}, "
        f"H={args.heads}/{args.kv_heads}, D={args.head_dim}, {args.dtype}, branch step {steps}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['method']:>9} {r['cp']:>3} {r['layers']:>6} {r['seq']:>7} {r['fwd_ms']:>9.1f} "
            f"{r['fwd_bwd_ms']:>11.1f} {r['fwd_temp_mib']:>13.1f} {r['fwd_bwd_temp_mib']:>17.1f} "
            f"{r['fwd_bwd_tflops_per_gpu']:>20.1f}"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
