"""The GPU kernels of one body of a jitted loop, from profiler traces, each named by its output
shape and JAX op where XLA dumps its optimized programs.

`loop_kernels` traces a loop at two lengths and keeps the difference, so that what a call runs
once (a prefill) drops out; run under `XLA_FLAGS="--xla_dump_to=D --xla_dump_hlo_module_re=..."`
and each fusion is named by its HLO (`hlo_ops`). `jspec.bench.rollout --profile` prints these
tables for its loops.
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import os
import pathlib
import re

import jax


def gpu_kernels(run, log_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """(ms, launches) per GPU kernel of one call of `run()` (compiled first), from the perfetto
    trace `jax.profiler.trace` writes under `log_dir`."""
    jax.block_until_ready(run())
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(run())
    path = max(pathlib.Path(log_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "GPU" in name or "gpu" in name}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            total[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    return total, count


# What a kernel's name says it is: matrix products (cuBLAS, XLA's gemm fusions), attention
# (jspec's Triton and Mosaic GPU kernels, cuDNN's flash attention); the rest is everything else.
KINDS = {
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas"),
    "attention": ("jspec_attention", "jspec_decode", "flash", "cudnn"),
}


def by_kind(ms: collections.Counter) -> dict[str, float]:
    """Kernel milliseconds by what each kernel is (`KINDS`), and "other"."""
    split = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, t in ms.items():
        low = name.lower()
        kind = next((k for k, marks in KINDS.items() if any(m in low for m in marks)), "other")
        split[kind] += t
    return split


def loop_kernels(run, log_dir: str, lengths: tuple[int, int], steps: int, top: int = 25) -> list:
    """(kernel, ms per step, launches per step, its HLO) of the `top` heaviest GPU kernels of one
    body of a loop: the kernels of `run(long)` less those of `run(short)` (`lengths`), over the
    `steps` between them, so that what a call runs once (a prefill) drops out. The HLO
    (`hlo_ops`) is empty unless XLA dumps the optimized programs."""
    (long_ms, long_n), (short_ms, short_n) = (
        gpu_kernels(lambda n=n: run(n), f"{log_dir}-{n}") for n in lengths
    )
    total, count = long_ms - short_ms, long_n - short_n  # (keeps the positive differences)
    if fewer := sorted(k for k in short_n if short_n[k] > long_n[k]):
        # Two `generate` lengths are two programs: XLA may name their fusions differently.
        print(f"{log_dir}: {len(fewer)} kernels ran more often in the shorter run: {fewer[:5]}")
    heaviest = [name for name, _ in total.most_common(top)]
    ops = hlo_ops(heaviest)
    rows = [(k, total[k] / steps, count[k] / steps, ops.get(k, "")) for k in heaviest]
    print(
        f"{log_dir}: GPU kernels per step ({sum(total.values()) / steps:.2f} ms in all, "
        f"{sum(count.values()) / steps:.0f} launches):"
    )
    for name, ms, n, op in rows:
        print(f"  {ms:8.3f} ms {n:6.1f}x  {name[:60]:60s} {op[:120]}")
    return rows


def hlo_ops(kernels: list[str]) -> dict[str, str]:
    """Output shape and JAX op of each kernel that is an XLA fusion (kernel `loop_add_fusion_7` is
    HLO `loop_add_fusion.7`), from the optimized programs XLA dumps when run with
    `XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=..."`: the program defining the most of
    `kernels` (fusion names repeat across programs). Empty without a dump."""
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    best: dict[str, str] = {}
    for path in pathlib.Path(dump.group(1)).glob("*after_optimizations.txt") if dump else ():
        defined = hlo_instructions(str(path), path.stat().st_mtime)
        hlo = {name: re.sub(r"_(\d+)$", r".\1", name) for name in kernels}
        found = {name: defined[h] for name, h in hlo.items() if h in defined}
        best = max(best, found, key=len)
    return best


@functools.cache
def hlo_instructions(path: str, mtime: float) -> dict[str, str]:
    """{instruction: "shape op"} of an HLO text file, read once (a dump can be large)."""
    defined = {}
    pattern = r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) [\w-]+\((.*)$"
    for m in re.finditer(pattern, pathlib.Path(path).read_text(), re.M):
        op = re.search(r'op_name="([^"]*)"', m.group(3))
        defined[m.group(1)] = f"{m.group(2)} {op.group(1).split('/body/')[-1] if op else ''}"
    return defined
