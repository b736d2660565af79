"""The Pallas block kernel on one GPU: correctness against the reference, then speed.

    python -m jspec.bench.check_gpu_attention            # everything, JSON to $OUT
    python -m jspec.bench.check_gpu_attention --no-sweep --iters 3

1. Correctness at small shapes (packed documents with padding, GQA, bf16 and float32): the
   kernel's output and gradients (through `attention(impl="pallas")`, and block-level `fwd`/`bwd`
   on keys out of order) against `reference_attention` / `blocks`. Error max|x-ref|/max|ref|,
   limits 2e-2 (bf16) and 1e-4 (float32). On a Hopper GPU with jax 0.11 the same for the Mosaic
   GPU kernel (`impl="mosaic"`, bf16 and head dims 64 and 128; its blocks continuing a running
   output, as the ring does).
2. Timing at B=1, T=32768, 32/8 heads, D=128, bf16: causal fwd and fwd+bwd of the kernel (a tile
   sweep first, unless --no-sweep), of cuDNN (`jax.nn.dot_product_attention`), and with packed
   documents the kernel against cuDNN's packed layout (each document causal on its own, given by
   its offset and length; its output checked against the kernel's) and the XLA block path
   (`jspec.attention.attention(impl="xla")`); the Mosaic GPU kernel's rows beside them where it
   runs.
   FLOPs count only the visible pairs; fwd+bwd counts
   the backward as 2.5 forwards. Prints a table and writes JSON (after every section, so a run
   cut short still leaves its results).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.attention import attention, blocks, mosaic_gpu, pallas_gpu, reference_attention
from jspec.attention.pallas_gpu import Tile
from jspec.bench.timing import time_compiled
from jspec.jobs import cli

# Correctness cases of the self-attention check: (impl, head dim, dtype).
CASES = (("pallas", 128, jnp.bfloat16), ("pallas", 128, jnp.float32), ("pallas", 64, jnp.bfloat16))
MOSAIC_CASES = (("mosaic", 128, jnp.bfloat16), ("mosaic", 64, jnp.bfloat16))
MOSAIC_FWD_64 = mosaic_gpu.Tiles(fwd_k=64, fwd_steps=3)  # the other forward tiling that fits
# The tile sweep: candidates per kernel, swept in this order (each sweep starts from the winners
# of the ones before it).
SWEEP = {
    "fwd": (Tile(128, 64, 8, 3), Tile(128, 128, 8, 3), Tile(128, 128, 8, 2), Tile(128, 64, 4, 3),
            Tile(64, 64, 4, 3)),
    "dkdv": (Tile(64, 128, 8, 2), Tile(32, 128, 8, 3), Tile(64, 128, 8, 3), Tile(32, 128, 4, 3),
             Tile(64, 64, 4, 3)),
    "dq": (Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(128, 32, 8, 3), Tile(128, 128, 8, 2),
           Tile(64, 64, 4, 3)),
}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=cli.at_least(1), default=32768)
    p.add_argument("--heads", type=cli.at_least(1), default=32)
    p.add_argument("--kv-heads", type=cli.at_least(1), default=8)
    p.add_argument("--head-dim", type=cli.at_least(1), default=128)
    p.add_argument("--iters", type=cli.at_least(1), default=5)
    p.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    p.add_argument("--no-xla", action="store_true", help="skip the XLA block path")
    p.add_argument(
        "--no-triton",
        action="store_true",
        help="time cuDNN and the Mosaic GPU kernel only (no sweep)",
    )
    p.add_argument(
        "--budget", type=cli.positive, default=330.0, help="seconds; later steps are skipped"
    )
    p.add_argument(
        "--reserve",
        type=cli.at_least(0, float),
        default=100.0,
        help="seconds the sweep leaves over",
    )
    p.add_argument("--json", default=None, help="default: $OUT/check_gpu_attention.json")
    return p.parse_args(argv)


@dataclasses.dataclass
class Run:
    """The report, the file it goes to and the time budget. Every row is written at once, so a run
    cut short still leaves its results."""

    args: argparse.Namespace
    start: float
    path: str
    report: dict

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.report, f, indent=1)

    def left(self):
        """Seconds left of --budget; later steps are skipped when it runs low."""
        return self.args.budget - (time.time() - self.start)

    def add(self, section, row, prefix=""):
        """Appends `row` to the report's `section`, prints it and writes the file."""
        self.report[section].append(row)
        print(prefix + json.dumps(row))
        self.save()


def require_gpu():
    """The first device; exits at once with a clear message where it is not a GPU (the kernel
    compiles for nothing else)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise SystemExit(
            f"check_gpu_attention needs an NVIDIA GPU, but JAX sees {dev.platform} "
            f"({dev.device_kind}); run it on a GPU machine with jax[cuda] installed."
        )
    return dev


def packed(rng, b, t, mean, pad_tail):
    """Rows of documents of random lengths (multiples of 8), then `pad_tail` padding tokens."""
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for r in range(b):
        s, doc = 0, 1
        while s < t - pad_tail:
            n = min(8 * int(rng.integers(1, max(2, mean // 4))), t - pad_tail - s)
            seg[r, s : s + n], pos[r, s : s + n] = doc, np.arange(n)
            s, doc = s + n, doc + 1
    return jnp.asarray(seg), jnp.asarray(pos)


def normal(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), dtype)


def err(x, ref):
    """max|x-ref| / max|ref|, in float32."""
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def grad_errs(grads, refs):
    """`err` of each of (dq, dk, dv), by name."""
    return {n: err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, refs, strict=True)}


def failed(e):
    """Prints the traceback and returns the error for the report: a failure is a row, the run
    goes on."""
    traceback.print_exc()
    return repr(e)[:500]


def reference(q, k, v, seg, pos):
    """`reference_attention` in float32 at full matmul precision: what the kernel must match."""
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return reference_attention(*f32, seg, pos)


def check_attention(rng, impl, d, dtype):
    """The row of `attention(impl=impl)` against `reference` on packed rows with padding and
    GQA: output and gradients within the dtype's limit, and zeros at the padding."""
    b, t, hq, hkv = 2, 1024, 8, 2
    name = f"{impl} self-attn packed+pad B={b} T={t} {hq}/{hkv} D={d} {jnp.dtype(dtype).name}"
    limit = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    try:
        seg, pos = packed(rng, b, t, 300, 40)
        q = normal(rng, (b, t, hq, d), dtype)
        k, v = normal(rng, (b, t, hkv, d), dtype), normal(rng, (b, t, hkv, d), dtype)
        ct = normal(rng, (b, t, hq, d), jnp.float32)

        def loss(fn):
            def f(q_, k_, v_):
                return jnp.sum(fn(q_, k_, v_, seg, pos).astype(jnp.float32) * ct)

            return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

        ours = functools.partial(attention, impl=impl)
        out = jax.jit(ours)(q, k, v, seg, pos)
        out_ref = jax.jit(reference)(q, k, v, seg, pos)
        _, grads = loss(ours)(q, k, v)
        _, grads_ref = loss(reference)(q, k, v)
        errs = {"out": err(out, out_ref), **grad_errs(grads, grads_ref)}
        pad_zero = bool(jnp.all(jnp.where((seg == 0)[..., None, None], out, 0) == 0))
        ok = max(errs.values()) < limit and pad_zero
    except Exception as e:  # noqa: BLE001 - report every failure, go on
        errs, ok, pad_zero = {"error": failed(e)}, False, None
    return {"case": name, "limit": limit, "ok": ok, "padding_out_zero": pad_zero, **errs}


def lse_errs(o, lse, o_ref, lse_ref, prefix=""):
    """Errors of an output and its log-sum-exp, and whether their queries that saw nothing
    (-inf) are the same."""
    fin = jnp.isfinite(lse_ref)
    return {
        f"{prefix}out": err(o, o_ref),
        f"{prefix}lse_abs": float(jnp.max(jnp.abs(jnp.where(fin, lse - lse_ref, 0)))),
        f"{prefix}lse_inf_match": bool(jnp.all(jnp.isfinite(lse) == fin)),
    }


def check_blocks(rng, module, dtype, limit):
    """The row of block-level `module.fwd`/`bwd` against `blocks.fwd`/`bwd` (float32 inputs of
    the same values): cross attention against keys in shuffled chunks, continuing a running output
    in which some queries have seen nothing yet, as a ring step hands the kernel; and the forward
    with nothing to continue (fresh_)."""
    name = f"{module.__name__.split('.')[-1]} blocks fwd/bwd, keys out of order, running output"
    try:
        seg, pos = packed(rng, 1, 512, 120, 16)
        perm = np.concatenate([np.arange(c * 64, c * 64 + 64) for c in (5, 0, 7, 2, 1, 6, 3, 4)])
        k_seg, k_pos = seg[:, perm], pos[:, perm]
        q_seg, q_pos = seg[:, 128:384], pos[:, 128:384]
        q = normal(rng, (1, 256, 4, 64), dtype)
        k, v = normal(rng, (1, 512, 1, 64), dtype), normal(rng, (1, 512, 1, 64), dtype)
        lse0 = normal(rng, (1, 256, 4), jnp.float32)
        lse0 = jnp.where(jnp.asarray(rng.random(lse0.shape) < 0.3), -jnp.inf, lse0)
        o0 = jnp.where(jnp.isinf(lse0)[..., None], 0.0, normal(rng, q.shape, jnp.float32))
        a = (q, k, v, q_seg, q_pos, k_seg, k_pos)
        kw = dict(scale=0.125, block_q=64, block_k=64)
        with jax.default_matmul_precision("highest"):
            f32 = [x.astype(jnp.float32) for x in a[:3]] + list(a[3:])
            o_ref, lse_ref = jax.jit(lambda *a: blocks.fwd(*a, **kw))(*f32, (o0, lse0))
            do = normal(rng, o_ref.shape, jnp.float32)
            delta = jnp.sum(do * o_ref, -1)
            dq0 = normal(rng, q.shape, jnp.float32)
            g_ref = jax.jit(lambda *a: blocks.bwd(*a, **kw))(*f32, lse_ref, do, delta, dq0)
            fresh_ref = jax.jit(lambda *a: blocks.fwd(*a, **kw))(*f32)
        o, lse = jax.jit(lambda *a: module.fwd(*a, **kw))(*a, (o0, lse0))
        g = jax.jit(lambda *a: module.bwd(*a, **kw))(*a, lse_ref, do, delta, dq0)
        fresh = jax.jit(lambda *a: module.fwd(*a, **kw))(*a)  # nothing to continue
        errs = {**lse_errs(o, lse, o_ref, lse_ref), **grad_errs(g, g_ref)}
        errs.update(lse_errs(*fresh, *fresh_ref, "fresh_"))
        ok = max(v for v in errs.values() if not isinstance(v, bool)) < limit
        ok = ok and errs["lse_inf_match"] and errs["fresh_lse_inf_match"]
    except Exception as e:  # noqa: BLE001
        errs, ok = {"error": failed(e)}, False
    return {"case": f"{name}, {jnp.dtype(dtype).name}", "limit": limit, "ok": ok, **errs}


def check_correctness(run):
    """Section 1: every correctness row, PASS or FAIL, before any timing, in order. The checks
    run in threads, each with inputs of its own seed, so that their programs compile at once:
    one after another, compiling took most of this section (some 200 s on a fresh machine)."""
    cases = CASES + (MOSAIC_CASES if mosaic_gpu.available() else ())
    checks = [(check_attention, case) for case in cases]
    checks.append((check_blocks, (pallas_gpu, jnp.float32, 1e-4)))
    if mosaic_gpu.available():
        checks.append((check_blocks, (mosaic_gpu, jnp.bfloat16, 2e-2)))
    for row in run_checks(checks):
        run.add("correctness", row, "PASS " if row["ok"] else "FAIL ")


def run_checks(checks):
    """The rows of `check(rng, *args)` for each (check, args), in order; the i-th with the random
    generator of seed i, all in threads at once."""
    with concurrent.futures.ThreadPoolExecutor(len(checks)) as pool:
        futures = [
            pool.submit(check, np.random.default_rng(i), *args)
            for i, (check, args) in enumerate(checks)
        ]
        yield from (f.result() for f in futures)


class Inputs(NamedTuple):
    """What every timed variant runs on: bf16 q, k, v and a cotangent at B=1; the (segments,
    positions) of one causal row and of packed documents; FLOPs of each, visible pairs only."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    ct: jax.Array
    causal: tuple[jax.Array, jax.Array]
    docs: tuple[jax.Array, jax.Array]
    causal_flops: float
    doc_flops: float

    @property
    def scale(self):
        return self.q.shape[-1] ** -0.5


def timing_inputs(args, rng):
    """The `Inputs` of section 2 at the command line's shape; documents of about 4K tokens."""
    b, t, hq, hkv, d = 1, args.seq, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.bfloat16
    q = normal(rng, (b, t, hq, d), dtype)
    k, v = normal(rng, (b, t, hkv, d), dtype), normal(rng, (b, t, hkv, d), dtype)
    ct = normal(rng, (b, t, hq, d), dtype)
    causal = jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    docs = packed(rng, b, t, 4096, 0)  # documents of about 4K tokens on average
    lengths = np.bincount(np.asarray(docs[0][0]))[1:]

    def flops(seg_lengths):
        return 4 * b * hq * d * sum(int(n) * (int(n) + 1) / 2 for n in seg_lengths)

    print(f"packed: {len(lengths)} documents, mean {lengths.mean():.0f} tokens")
    return Inputs(q, k, v, ct, causal, docs, flops([t]), flops(lengths))


def fwd_bwd(attn, ct):
    """The gradients of <attn(q, k, v), ct> in q, k, v: one forward and its backward."""

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def kernel_fwd(module, tiles, seg, pos, scale, continued=False):
    """The forward kernel of `module` (pallas_gpu or mosaic_gpu) alone, its output and not the
    log-sum-exp, with these tiles: self-attention under (seg, pos); with `continued`, continuing
    an empty running output, as a ring's first step does."""

    def fwd(q, k, v):
        acc = blocks.empty_acc(q) if continued else None
        return module.fwd(q, k, v, seg, pos, seg, pos, acc, scale=scale, tiles=tiles)[0]

    return fwd


def timed(run, name, fwd_fn, fb_fn, n_flops, xs):
    """One row of the table: ms, compile s and TFLOP/s of the forward and of forward+backward (the
    backward counted as 2.5 forwards). A part is skipped with under 20 s of the budget left."""
    row = {"name": name}
    for key, fn in (("fwd", fwd_fn), ("fwd_bwd", fb_fn)):
        if fn is None or run.left() < 20:
            continue
        try:
            ms, cs, _, _ = time_compiled(fn, xs, run.args.iters)
            scale = 1.0 if key == "fwd" else 3.5
            row[f"{key}_ms"], row[f"{key}_compile_s"] = ms, cs
            row[f"{key}_tflops"] = scale * n_flops / ms / 1e9
        except Exception as e:  # noqa: BLE001
            row[f"{key}_error"] = failed(e)
    run.add("timing", row)
    return row


def sweep_kernel(run, tiles, kind, make, xs):
    """`tiles` with the fastest of SWEEP[kind] for that kernel (`make(tiles)` times it); stops while
    --reserve seconds are left, for the comparison after it."""
    best = None
    for tile in SWEEP[kind]:
        if run.left() < run.args.reserve:
            break
        tl = tiles._replace(**{kind: tile})
        row = {"kernel": kind, "tile": tile._asdict()}
        try:
            row["ms"], row["compile_s"], _, _ = time_compiled(make(tl), xs, run.args.iters)
            if best is None or row["ms"] < best[0]:
                best = (row["ms"], tile)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        run.add("sweep", row)
    return tiles if best is None else tiles._replace(**{kind: best[1]})


def sweep_tiles(run, x):
    """The tile sweep on the causal row: the forward kernel alone, then the two backward kernels
    (given the forward's lse). Returns the best tiles found, starting from `pallas_gpu.TILES`."""
    causal = (*x.causal, *x.causal)
    xs = (x.q, x.k, x.v)
    o, lse = jax.jit(lambda q, k, v: pallas_gpu.fwd(q, k, v, *causal, scale=x.scale))(*xs)
    delta = jnp.sum(x.ct.astype(jnp.float32) * o, -1)

    def kernel_bwd(tl):
        return lambda q, k, v: pallas_gpu.bwd(
            q, k, v, *causal, lse, x.ct, delta, scale=x.scale, tiles=tl
        )

    makes = {
        "fwd": lambda tl: kernel_fwd(pallas_gpu, tl, *x.causal, x.scale),
        "dkdv": kernel_bwd,
        "dq": kernel_bwd,
    }
    tiles = pallas_gpu.TILES
    for kind, make in makes.items():
        tiles = sweep_kernel(run, tiles, kind, make, xs)
    run.report["best_tiles"] = [t._asdict() for t in tiles]
    print("best tiles:", tiles)
    return tiles


def cudnn_packed(seg, scale):
    """cuDNN's attention over the documents of one packed row (numbered 1, 2, ... in order, as
    `packed` makes them), each causal on its own: its packed layout, where each document is
    given by its offset and length (cuDNN 9.6 or later; JAX exposes it only in a private module,
    imported where it runs, so that a JAX without it fails this row alone)."""
    lengths = np.bincount(np.asarray(seg[0]))[1:]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1], [-1]])[None].astype(np.int32)
    seqlen = jnp.asarray(lengths[None], jnp.int32)

    def attn(q, k, v):
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

        return cudnn_attention.dot_product_attention(
            q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=jnp.asarray(starts),
            kv_offsets=jnp.asarray(starts), scale=scale, mask_type=cudnn_attention.MaskType.CAUSAL,
        )  # fmt: skip

    return attn


def compare(run, x, tiles):
    """The rows of the table: cuDNN and (unless --no-triton) the kernel on the causal row and on
    packed documents (the library's calls with `tiles`), the Mosaic GPU kernel on both where it
    runs (and its other forward tiling on the causal row), and (unless --no-xla) the XLA block
    path on the same documents."""
    xs = (x.q, x.k, x.v)

    def lib(impl, seg, pos, tl=tiles):
        return lambda q, k, v: attention(q, k, v, seg, pos, impl=impl, tiles=tl)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    rows = [timed(run, "cudnn causal", cudnn, fwd_bwd(cudnn, x.ct), x.causal_flops, xs)]
    docs = cudnn_packed(x.docs[0], x.scale)
    rows.append(timed(run, "cudnn packed docs", docs, fwd_bwd(docs, x.ct), x.doc_flops, xs))
    checked = "mosaic" if run.args.no_triton and mosaic_gpu.available() else "pallas"
    kernel = lib(checked, *x.docs, tl=mosaic_gpu.TILES if checked == "mosaic" else tiles)
    try:  # its masks, checked against a kernel's output
        mismatch = {"err": err(jax.jit(docs)(*xs), jax.jit(kernel)(*xs))}
    except Exception as e:  # noqa: BLE001
        mismatch = {"error": failed(e)}
    run.add("timing", {"name": "cudnn packed docs vs the kernel", **mismatch})
    triton = (
        ("pallas causal", x.causal, x.causal_flops),
        ("pallas packed docs", x.docs, x.doc_flops),
    )
    for name, (seg, pos), n_flops in () if run.args.no_triton else triton:
        fwd_fn = kernel_fwd(pallas_gpu, tiles, seg, pos, x.scale)
        rows.append(timed(run, name, fwd_fn, fwd_bwd(lib("pallas", seg, pos), x.ct), n_flops, xs))
    if mosaic_gpu.available():
        for name, (seg, pos), n_flops, tl in (
            ("mosaic causal", x.causal, x.causal_flops, mosaic_gpu.TILES),
            ("mosaic packed docs", x.docs, x.doc_flops, mosaic_gpu.TILES),
            ("mosaic causal, fwd 64 keys x 3", x.causal, x.causal_flops, MOSAIC_FWD_64),
        ):
            fwd_fn = kernel_fwd(mosaic_gpu, tl, seg, pos, x.scale)
            rows.append(
                timed(run, name, fwd_fn, fwd_bwd(lib("mosaic", seg, pos, tl), x.ct), n_flops, xs)
            )
        empty = kernel_fwd(mosaic_gpu, mosaic_gpu.TILES, *x.docs, x.scale, continued=True)
        rows.append(timed(run, "mosaic packed, fwd from (0,-inf)", empty, None, x.doc_flops, xs))
    if not run.args.no_xla:
        xla = lib("xla", *x.docs)
        rows.append(
            timed(run, "attention(impl=xla) packed", xla, fwd_bwd(xla, x.ct), x.doc_flops, xs)
        )
    return rows


def print_table(run, x, rows):
    """The correctness rows and the timing table, after everything ran."""
    (b, t, hq, d), hkv = x.q.shape, x.k.shape[2]
    print()
    print(f"{run.report['device']}, jax {jax.__version__}, B={b} T={t} H={hq}/{hkv} D={d} bf16")
    print("correctness:")
    for r in run.report["correctness"]:
        e = {k_: v_ for k_, v_ in r.items() if k_ not in ("case", "limit", "ok")}
        print(f"  {'PASS' if r['ok'] else 'FAIL'} {r['case']}: {e}")
    print(f"{'path':32} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        print(
            f"{r['name']:32} {r.get('fwd_ms', float('nan')):>9.2f} "
            f"{r.get('fwd_tflops', float('nan')):>8.1f} {r.get('fwd_bwd_ms', float('nan')):>11.2f} "
            f"{r.get('fwd_bwd_tflops', float('nan')):>8.1f}"
        )


def summarize(rows):
    """Speed-ups of the kernel: cuDNN's ms over its ms on the causal row, the XLA path's over its
    on documents. Where a time is missing (a part skipped or failed) its ratio is left out, and
    the causal fwd ratio with the fwd+bwd one."""
    by = {r["name"]: r for r in rows}

    def ratio(key, theirs, ours):
        return by[theirs][key] / by[ours][key]

    summary = {}
    with contextlib.suppress(KeyError):
        summary["causal_fwd_bwd_vs_cudnn"] = ratio("fwd_bwd_ms", "cudnn causal", "pallas causal")
        summary["causal_fwd_vs_cudnn"] = ratio("fwd_ms", "cudnn causal", "pallas causal")
    with contextlib.suppress(KeyError):
        summary["mosaic_causal_fwd_bwd_vs_cudnn"] = ratio(
            "fwd_bwd_ms", "cudnn causal", "mosaic causal"
        )
        summary["mosaic_causal_fwd_vs_cudnn"] = ratio("fwd_ms", "cudnn causal", "mosaic causal")
    with contextlib.suppress(KeyError):
        summary["mosaic_packed_fwd_bwd_vs_cudnn"] = ratio(
            "fwd_bwd_ms", "cudnn packed docs", "mosaic packed docs"
        )
        summary["mosaic_packed_fwd_vs_cudnn"] = ratio(
            "fwd_ms", "cudnn packed docs", "mosaic packed docs"
        )
    with contextlib.suppress(KeyError):
        summary["packed_fwd_bwd_speedup_vs_xla"] = ratio(
            "fwd_bwd_ms", "attention(impl=xla) packed", "pallas packed docs"
        )
    return summary


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    path = args.json or os.path.join(os.environ.get("OUT", "."), "check_gpu_attention.json")
    dev = require_gpu()
    report = {
        "args": vars(args),
        "jax": jax.__version__,
        "device": dev.device_kind,
        "available": pallas_gpu.available(),
        "mosaic_available": mosaic_gpu.available(),
        "default_tiles": [t._asdict() for t in pallas_gpu.TILES],
        "correctness": [],
        "timing": [],
        "sweep": [],
    }
    run = Run(args, start, path, report)
    print(f"jax {jax.__version__}, {dev.device_kind}, pallas available: {report['available']}")
    check_correctness(run)
    x = timing_inputs(args, np.random.default_rng(0))
    tiles = pallas_gpu.TILES if args.no_sweep or args.no_triton else sweep_tiles(run, x)
    rows = compare(run, x, tiles)
    print_table(run, x, rows)
    report["summary"] = summary = summarize(rows)
    print("summary:", json.dumps(summary))
    print(f"total {time.time() - start:.0f} s; wrote {path}")
    run.save()


if __name__ == "__main__":
    sys.exit(cli.run(main))
