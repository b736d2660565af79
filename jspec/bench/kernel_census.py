"""The kernels of a rollout's loop as XLA's GPU compiler makes them, on a machine with no GPU: the
planner's rollout program (`jspec.jobs.plan`) compiled for a GPU from its description
(`--gpu-target`, jax's CUDA plugin), each loop body's kernels counted by kind and by part of the
step (the draft's tree, the target's forward, verification, the caches' advance, the draft's
extension: named scopes of `jspec.sampler.generation`), those that write an array as large as a
weight listed, and one layer's kernels in the order they run. A decode step of a small model at
small batch is bound by its launches and by any weight it reads twice, which is what this shows
before a profile on the GPU (`jspec.bench.rollout --profile`) times them. No kernel is autotuned
here, and a count is not a time: a kernel that replaces several must also run at their speed.

    python -m jspec.bench.kernel_census --config code-1b --batch 1            # plain decoding
    python -m jspec.bench.kernel_census --config code-rl --batch 128 --draft  # the RL rollout
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import re
import sys
from typing import NamedTuple

from jspec import config as config_lib
from jspec.jobs import cli, plan, plan_devices

# A kernel writing this many elements or more inside a decode loop is reported: as large as a
# small model's weight (a 1024 x 1024 product), far above a decode step's activations.
LARGE = 1 << 20


class Kernel(NamedTuple):
    """One kernel of a loop body: its HLO op (fusion or custom-call), what it computes (the
    fusion's computation, numbers dropped, or the custom call's target), the elements it writes
    and the JAX op it came from."""

    op: str
    name: str
    elements: int
    jax_op: str


def loop_bodies(compiled_text: str) -> dict[str, list[Kernel]]:
    """The kernels (fusions and custom calls) of each while loop body of a compiled GPU program's
    text, by body."""
    bodies = {}
    for body in sorted(set(re.findall(r"body=%?([\w.\-]+)", compiled_text))):
        text = compiled_text.split(f"\n%{body} ", 1)[1].split("\n}\n", 1)[0]
        bodies[body] = [_kernel(line) for line in text.splitlines() if _is_kernel(line)]
    return bodies


# An instruction that launches a kernel: `%name = TYPE fusion(` or `custom-call(`, TYPE one
# array's or, for a kernel of several outputs, a tuple of them.
_LAUNCH = re.compile(r"= (?:\([^=]*\)|\S+) (fusion|custom-call)\(")


def _is_kernel(line: str) -> bool:
    return _LAUNCH.search(line) is not None


def _kernel(line: str) -> Kernel:
    """The kernel of an instruction: its first output's elements stand for what it writes."""
    dims = re.search(r"= \(?\w+\[([\d,]*)\]", line)[1]
    op = _LAUNCH.search(line)[1]
    called = re.search(r'calls=%?([\w.\-]+)|custom_call_target="([^"]+)"', line)
    name = re.sub(r"[._]\d+(_computation)?$", "", called[1] or called[2]) if called else op
    jax_op = re.search(r'op_name="([^"]*)"', line)
    return Kernel(
        op,
        name,
        math.prod(int(d) for d in dims.split(",") if d),
        jax_op[1].split("/body/")[-1] if jax_op else "",
    )


def decode_loop(bodies: dict[str, list[Kernel]]) -> list[Kernel]:
    """The kernels of the loop that decodes: the largest body."""
    return max(bodies.values(), key=len)


def compile_rollout(args) -> tuple[object, config_lib.Config]:
    """The rollout program of `args` (config, overrides, batch, prompt, draft) compiled for one
    GPU of `args.gpu_target`'s description, and its config."""
    plain = ["rollout.draft.kind=none", "rollout.temperature=0.0"] * (not args.draft)
    overrides = [*plain, f"rollout.max_new_tokens={args.new}", *args.overrides]
    described = plan_devices.gpu_target(args.gpu_target)
    [device] = plan_devices.gpu_topology_devices("1x1", described)
    cfg, networks, params = plan.on_one_device(
        args.config, overrides, args.prompt + args.new, device
    )
    compiled, _ = plan.rollout_step(cfg, networks, params, args.prompt, args.batch)
    return compiled, cfg


# The parts of a decode step (named scopes of `jspec.sampler.generation`), in the order it runs.
PARTS = ("draft_tree", "target_forward", "verify", "cache_advance", "draft_extend")


def part(kernel: Kernel) -> str:
    """The part of the step a kernel belongs to ('other': the step's own bookkeeping, and kernels
    XLA left without an op_name, such as some custom calls: `parts` places those)."""
    return next((p for p in PARTS if kernel.jax_op.startswith(p + "/")), "other")


def parts(kernels: list[Kernel]) -> list[str]:
    """The part of the step of each kernel (`part`); one that XLA left without an op name (a
    split-K product, a TopK) takes the part of the kernel before it."""
    named = []
    for k in kernels:
        named.append(part(k) if k.jax_op or not named else named[-1])
    return named


def one_layer(kernels: list[Kernel], layers: int) -> list[Kernel]:
    """The kernels of one layer of the target's forward, in the order they run: the span between
    two occurrences of the first kernel the forward runs once a layer (its second and third, past
    what the first layer hoists), kernels XLA left without an op name included; or the whole
    forward where none repeats so."""
    forward = [k for k in kernels if part(k) == "target_forward"]
    counts = collections.Counter(forward)
    marker = next((k for k in forward if counts[k] == layers > 1), None)
    if marker is None:
        return forward
    at = [i for i, k in enumerate(kernels) if k == marker]
    return kernels[at[1] : at[2]] if layers > 2 else kernels[at[0] : at[1]]


def table(kernels: list[Kernel], layers: int) -> str:
    """Kernels by what they compute (per step and per layer), by part of the step, the large
    writes, then one layer's kernels in order."""
    kinds = collections.Counter((k.op, k.name) for k in kernels)
    lines = [f"{len(kernels)} kernels a step, {len(kernels) / layers:.1f} a layer:"]
    lines += [f"  {n:5d}  {op:12s} {name}" for (op, name), n in kinds.most_common()]
    count = collections.Counter(parts(kernels))
    lines.append("by part: " + ", ".join(f"{p} {count[p]}" for p in (*PARTS, "other") if count[p]))
    large = collections.Counter((k.elements, k.jax_op) for k in kernels if k.elements >= LARGE)
    lines.append(f"writes of {LARGE:,} elements or more: {'none' if not large else ''}")
    lines += [f"  {n:5d}  {size:,} elements, {op}" for (size, op), n in large.most_common()]
    lines.append("one layer of the target, in order:")
    lines += [
        f"  {k.op:12s} {k.name:32s} {k.elements:>10,}  {k.jax_op}"
        for k in one_layer(kernels, layers)
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    p.add_argument("--batch", type=cli.at_least(1), default=1, help="rows decoded together")
    p.add_argument("--prompt", type=cli.at_least(1), default=512, help="prompt tokens")
    p.add_argument(
        "--new", type=cli.at_least(1), default=64, help="new tokens (the cache's length)"
    )
    p.add_argument("--draft", action="store_true", help="speculative: the config's draft and tree")
    p.add_argument("--gpu-target", default="h200", help="the GPU description (as the planner's)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_kernel_census.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    compiled, cfg = compile_rollout(args)
    kernels = decode_loop(loop_bodies(compiled.as_text()))
    mode = f"speculative ({cfg.rollout.tree.kind})" if args.draft else "plain"
    print(f"{cfg.name}, batch {args.batch}, {mode} decoding, for {args.gpu_target}:")
    print(table(kernels, cfg.model.num_layers))
    args.out.write_text(json.dumps([k._asdict() for k in kernels], indent=1))


if __name__ == "__main__":
    sys.exit(cli.run(main))
