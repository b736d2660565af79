"""The Pallas block kernel on one GPU: correctness against the reference, then speed.

    python -m jspec.launch.check_gpu_attention            # everything, JSON to $OUT
    python -m jspec.launch.check_gpu_attention --no-sweep --iters 3

1. Correctness at small shapes (packed documents with padding, GQA, bf16 and float32): the
   kernel's output and gradients (through `attention(impl="pallas")`, and block-level `fwd`/`bwd`
   on keys out of order) against `reference_attention` / `blocks`. Error max|x-ref|/max|ref|,
   limits 2e-2 (bf16) and 1e-4 (float32).
2. Timing at B=1, T=32768, 32/8 heads, D=128, bf16: causal fwd and fwd+bwd of the kernel (a tile
   sweep first, unless --no-sweep), of cuDNN (`jax.nn.dot_product_attention`), and with packed
   documents the kernel against the XLA block path (`jspec.attention.attention(impl="xla")`).
   FLOPs count only the visible pairs; fwd+bwd counts
   the backward as 2.5 forwards. Prints a table and writes JSON (after every section, so a run
   cut short still leaves its results).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    p.add_argument("--no-xla", action="store_true", help="skip the XLA block path")
    p.add_argument("--budget", type=float, default=330.0, help="seconds; later steps are skipped")
    p.add_argument("--reserve", type=float, default=100.0, help="seconds the sweep leaves over")
    p.add_argument("--json", default=None, help="default: $OUT/check_gpu_attention.json")
    return p.parse_args(argv)


def main(argv=None):  # noqa: C901 - one linear script
    args = parse_args(argv)
    start = time.time()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.attention import attention, blocks, pallas_gpu, reference_attention
    from jspec.attention.pallas_gpu import Tile

    path = args.json or os.path.join(os.environ.get("OUT", "."), "check_gpu_attention.json")
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise SystemExit(
            f"check_gpu_attention needs an NVIDIA GPU, but JAX sees {dev.platform} "
            f"({dev.device_kind}); run it on a GPU machine with jax[cuda] installed."
        )
    report = {
        "args": vars(args),
        "jax": jax.__version__,
        "device": dev.device_kind,
        "available": pallas_gpu.available(),
        "default_tiles": [t._asdict() for t in pallas_gpu.TILES],
        "correctness": [],
        "timing": [],
        "sweep": [],
    }

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    def left():
        return args.budget - (time.time() - start)

    print(f"jax {jax.__version__}, {dev.device_kind}, pallas available: {report['available']}")
    rng = np.random.default_rng(0)

    def packed(b, t, mean, pad_tail):
        """Rows of documents of random lengths (multiples of 8), then `pad_tail` padding tokens."""
        seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        for r in range(b):
            s, doc = 0, 1
            while s < t - pad_tail:
                n = min(8 * int(rng.integers(1, max(2, mean // 4))), t - pad_tail - s)
                seg[r, s : s + n], pos[r, s : s + n] = doc, np.arange(n)
                s, doc = s + n, doc + 1
        return jnp.asarray(seg), jnp.asarray(pos)

    def normal(shape, dtype):
        return jnp.asarray(rng.normal(size=shape), dtype)

    def err(x, ref):
        x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
        return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))

    # ------------------------------------------------------------------------------------------
    # 1. Correctness.
    b, t, hq, hkv = 2, 1024, 8, 2
    for d, dtype in ((128, jnp.bfloat16), (128, jnp.float32), (64, jnp.bfloat16)):
        name = f"self-attn packed+pad B={b} T={t} {hq}/{hkv} D={d} {jnp.dtype(dtype).name}"
        limit = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        try:
            seg, pos = packed(b, t, 300, 40)
            q = normal((b, t, hq, d), dtype)
            k, v = normal((b, t, hkv, d), dtype), normal((b, t, hkv, d), dtype)
            ct = normal((b, t, hq, d), jnp.float32)

            def loss(fn, seg=seg, pos=pos, ct=ct):
                def f(q_, k_, v_):
                    return jnp.sum(fn(q_, k_, v_, seg, pos).astype(jnp.float32) * ct)

                return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

            def ref(q, k, v, seg, pos):
                with jax.default_matmul_precision("highest"):
                    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                    return reference_attention(*f32, seg, pos)

            ours = functools.partial(attention, impl="pallas")
            out = jax.jit(ours)(q, k, v, seg, pos)
            out_ref = jax.jit(ref)(q, k, v, seg, pos)
            _, grads = loss(ours)(q, k, v)
            _, grads_ref = loss(ref)(q, k, v)
            errs = {"out": err(out, out_ref)}
            for n, g, r in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
                errs[n] = err(g, r)
            pad_zero = bool(jnp.all(jnp.where((seg == 0)[..., None, None], out, 0) == 0))
            ok = max(errs.values()) < limit and pad_zero
        except Exception as e:  # noqa: BLE001 - report every failure, go on
            traceback.print_exc()
            errs, ok, pad_zero = {"error": repr(e)[:500]}, False, None
        row = {"case": name, "limit": limit, "ok": ok, "padding_out_zero": pad_zero, **errs}
        report["correctness"].append(row)
        print(("PASS " if ok else "FAIL ") + json.dumps(row))
        save()

    # Block level, cross attention against keys in shuffled chunks (a ring step), float32.
    try:
        seg, pos = packed(1, 512, 120, 16)
        perm = np.concatenate([np.arange(c * 64, c * 64 + 64) for c in (5, 0, 7, 2, 1, 6, 3, 4)])
        k_seg, k_pos = seg[:, perm], pos[:, perm]
        q_seg, q_pos = seg[:, 128:384], pos[:, 128:384]
        q = normal((1, 256, 4, 64), jnp.float32)
        k, v = normal((1, 512, 1, 64), jnp.float32), normal((1, 512, 1, 64), jnp.float32)
        a = (q, k, v, q_seg, q_pos, k_seg, k_pos)
        kw = dict(scale=0.125, block_q=64, block_k=64)
        with jax.default_matmul_precision("highest"):
            o_ref, lse_ref = jax.jit(lambda *a: blocks.fwd(*a, **kw))(*a)
            do = normal(o_ref.shape, jnp.float32)
            delta = jnp.sum(do * o_ref, -1)
            g_ref = jax.jit(lambda *a: blocks.bwd(*a, **kw))(*a, lse_ref, do, delta)
        o, lse = jax.jit(lambda *a: pallas_gpu.fwd(*a, **kw))(*a)
        g = jax.jit(lambda *a: pallas_gpu.bwd(*a, **kw))(*a, lse_ref, do, delta)
        fin = jnp.isfinite(lse_ref)
        errs = {
            "out": err(o, o_ref),
            "lse_abs": float(jnp.max(jnp.abs(jnp.where(fin, lse - lse_ref, 0)))),
            "lse_inf_match": bool(jnp.all(jnp.isfinite(lse) == fin)),
            **{n: err(x, y) for n, x, y in zip(("dq", "dk", "dv"), g, g_ref, strict=True)},
        }
        ok = max(v for v in errs.values() if not isinstance(v, bool)) < 1e-4
        ok = ok and errs["lse_inf_match"]
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        errs, ok = {"error": repr(e)[:500]}, False
    row = {"case": "blocks fwd/bwd, keys out of order, f32", "limit": 1e-4, "ok": ok, **errs}
    report["correctness"].append(row)
    print(("PASS " if ok else "FAIL ") + json.dumps(row))
    save()

    # ------------------------------------------------------------------------------------------
    # 2. Timing.
    b, t, hq, hkv, d = 1, args.seq, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.bfloat16
    q = normal((b, t, hq, d), dtype)
    k, v = normal((b, t, hkv, d), dtype), normal((b, t, hkv, d), dtype)
    ct = normal((b, t, hq, d), dtype)
    causal_seg = jnp.ones((b, t), jnp.int32)
    causal_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    doc_seg, doc_pos = packed(b, t, 4096, 0)  # documents of about 4K tokens on average
    lengths = np.bincount(np.asarray(doc_seg[0]))[1:]

    def flops(seg_lengths):
        return 4 * b * hq * d * sum(int(n) * (int(n) + 1) / 2 for n in seg_lengths)

    causal_flops, doc_flops = flops([t]), flops(lengths)
    print(f"packed: {len(lengths)} documents, mean {lengths.mean():.0f} tokens")

    def bench(fn, *xs):
        """Mean ms per call over args.iters calls after one warm-up; the compile time."""
        f = jax.jit(fn)
        c0 = time.perf_counter()
        jax.block_until_ready(f(*xs))
        compile_s = time.perf_counter() - c0
        t0 = time.perf_counter()
        for _ in range(args.iters):
            out = f(*xs)
        jax.block_until_ready(out)
        return 1e3 * (time.perf_counter() - t0) / args.iters, compile_s

    def fwd_bwd(attn):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))

    def timed(name, fwd_fn, fb_fn, n_flops, xs):
        row = {"name": name}
        for key, fn in (("fwd", fwd_fn), ("fwd_bwd", fb_fn)):
            if fn is None or left() < 20:
                continue
            try:
                ms, cs = bench(fn, *xs)
                scale = 1.0 if key == "fwd" else 3.5
                row[f"{key}_ms"], row[f"{key}_compile_s"] = ms, cs
                row[f"{key}_tflops"] = scale * n_flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row[f"{key}_error"] = repr(e)[:500]
        report["timing"].append(row)
        print(json.dumps(row))
        save()
        return row

    scale = d**-0.5

    def kernel_fwd(tiles, seg, pos):
        return lambda q, k, v: pallas_gpu.fwd(
            q, k, v, seg, pos, seg, pos, scale=scale, tiles=tiles
        )[0]

    # Tile sweep on the causal case: forward kernel alone, then the two backward kernels.
    tiles = pallas_gpu.TILES
    if not args.no_sweep:
        causal = (causal_seg, causal_pos, causal_seg, causal_pos)
        o, lse = jax.jit(lambda q, k, v: pallas_gpu.fwd(q, k, v, *causal, scale=scale))(q, k, v)
        delta = jnp.sum(ct.astype(jnp.float32) * o, -1)

        def kernel_bwd(tl):
            return lambda q, k, v: pallas_gpu.bwd(
                q, k, v, *causal, lse, ct, delta, scale=scale, tiles=tl
            )

        def sweep(kind, cands, make):
            best = None
            for tile in cands:
                if left() < args.reserve:  # keep time for the comparison below
                    break
                tl = tiles._replace(**{kind: tile})
                row = {"kernel": kind, "tile": tile._asdict()}
                try:
                    row["ms"], row["compile_s"] = bench(make(tl), q, k, v)
                    if best is None or row["ms"] < best[0]:
                        best = (row["ms"], tile)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                report["sweep"].append(row)
                print(json.dumps(row))
                save()
            return tiles if best is None else tiles._replace(**{kind: best[1]})

        tiles = sweep(
            "fwd",
            [Tile(128, 64, 8, 3), Tile(128, 128, 8, 3), Tile(128, 128, 8, 2), Tile(128, 64, 4, 3),
             Tile(64, 64, 4, 3)],
            lambda tl: kernel_fwd(tl, causal_seg, causal_pos),
        )  # fmt: skip
        tiles = sweep(
            "dkdv",
            [Tile(64, 128, 8, 2), Tile(32, 128, 8, 3), Tile(64, 128, 8, 3), Tile(32, 128, 4, 3),
             Tile(64, 64, 4, 3)],
            kernel_bwd,
        )  # fmt: skip
        tiles = sweep(
            "dq",
            [Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(128, 32, 8, 3), Tile(128, 128, 8, 2),
             Tile(64, 64, 4, 3)],
            kernel_bwd,
        )  # fmt: skip
        report["best_tiles"] = [x._asdict() for x in tiles]
        print("best tiles:", tiles)

    pallas_gpu.TILES = tiles  # the library's calls below take the swept tiles

    def lib(impl, seg, pos):
        return lambda q, k, v: attention(q, k, v, seg, pos, impl=impl)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    xs = (q, k, v)
    rows = [
        timed("cudnn causal", cudnn, fwd_bwd(cudnn), causal_flops, xs),
        timed(
            "pallas causal",
            kernel_fwd(tiles, causal_seg, causal_pos),
            fwd_bwd(lib("pallas", causal_seg, causal_pos)),
            causal_flops,
            xs,
        ),
        timed(
            "pallas packed docs",
            kernel_fwd(tiles, doc_seg, doc_pos),
            fwd_bwd(lib("pallas", doc_seg, doc_pos)),
            doc_flops,
            xs,
        ),
    ]

    if not args.no_xla:
        rows.append(
            timed(
                "attention(impl=xla) packed",
                lib("xla", doc_seg, doc_pos),
                fwd_bwd(lib("xla", doc_seg, doc_pos)),
                doc_flops,
                xs,
            )
        )

    # ------------------------------------------------------------------------------------------
    # Table.
    print()
    print(f"{dev.device_kind}, jax {jax.__version__}, B={b} T={t} H={hq}/{hkv} D={d} bf16")
    print("correctness:")
    for r in report["correctness"]:
        e = {k_: v_ for k_, v_ in r.items() if k_ not in ("case", "limit", "ok")}
        print(f"  {'PASS' if r['ok'] else 'FAIL'} {r['case']}: {e}")
    print(f"{'path':32} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        print(
            f"{r['name']:32} {r.get('fwd_ms', float('nan')):>9.2f} "
            f"{r.get('fwd_tflops', float('nan')):>8.1f} {r.get('fwd_bwd_ms', float('nan')):>11.2f} "
            f"{r.get('fwd_bwd_tflops', float('nan')):>8.1f}"
        )
    by = {r["name"]: r for r in rows}
    summary = {}
    try:
        summary["causal_fwd_bwd_vs_cudnn"] = (
            by["cudnn causal"]["fwd_bwd_ms"] / by["pallas causal"]["fwd_bwd_ms"]
        )
        summary["causal_fwd_vs_cudnn"] = (
            by["cudnn causal"]["fwd_ms"] / by["pallas causal"]["fwd_ms"]
        )
    except KeyError:
        pass
    try:
        summary["packed_fwd_bwd_speedup_vs_xla"] = (
            by["attention(impl=xla) packed"]["fwd_bwd_ms"] / by["pallas packed docs"]["fwd_bwd_ms"]
        )
    except KeyError:
        pass
    report["summary"] = summary
    print("summary:", json.dumps(summary))
    print(f"total {time.time() - start:.0f} s; wrote {path}")
    save()


if __name__ == "__main__":
    main()
