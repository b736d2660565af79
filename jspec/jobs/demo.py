"""CPU demo: a small Qwen3-style model generates plainly and speculatively, and checks itself.

    python -m jspec.jobs.demo                     # configs/demo.yaml, random weights
    python -m jspec.jobs.demo --config tiny model.num_layers=12 rollout.max_new_tokens=64
    python -m jspec.jobs.demo --checkpoint /path/to/hf/qwen3   # a Hugging Face checkpoint

Both runs are one jitted program each (`jspec.sampler.generate`) on one device (the config's mesh
section is train_rl's): plain decoding, then speculative decoding with the draft and tree of the
config's `rollout` section. With greedy decoding the two
must agree token for token, and the plain tokens must be the argmax of one training forward over
prompt + generation: the cache path, the verify path and the training path agree.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import config as config_lib
from jspec.jobs import cli
from jspec.models import create, draft_factory, hf
from jspec.sampler import generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=12")
    p.add_argument("--config", default="demo", help="config name in configs/ or a YAML path")
    p.add_argument("--checkpoint", default=None, help="Hugging Face checkpoint directory")
    p.add_argument("--batch", type=cli.at_least(1), default=4)
    p.add_argument("--prompt-len", type=cli.at_least(2), default=16)
    return p.parse_args(argv)


def timed(run):
    """(result, seconds) of the second call: the first compiles."""
    jax.block_until_ready(run(0))
    start = time.perf_counter()
    out = jax.block_until_ready(run(1))
    return out, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    cfg = config_lib.load(args.config, args.overrides)
    model = hf.load(args.checkpoint) if args.checkpoint else create(cfg.model, seed=cfg.seed)
    c, rollout = model.config, cfg.rollout
    print(
        f"model: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/"
        f"{c.num_kv_heads}, vocab {c.vocab_size}, on {jax.devices()[0].platform}"
    )
    rng = np.random.default_rng(cfg.seed)
    b, t = args.batch, args.prompt_len
    prompts = jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32)  # ragged prompts
    prompts = jnp.where(jnp.arange(t) < lengths[:, None], prompts, 0)
    drafter = draft_factory.from_config(rollout.draft, model, seed=cfg.seed)

    runs = {"plain": None, f"speculative ({rollout.draft.kind} draft)": drafter}
    results = {}
    for name, d in runs.items():
        run = lambda k, d=d: generate(model, d, prompts, lengths, jax.random.key(k), rollout)
        out, seconds = timed(run)
        results[name] = out
        tokens = int(np.sum(out.lengths))
        print(
            f"{name}: {tokens / seconds:,.0f} tokens/s, "
            f"mean accepted length {out.stats.mean_accepted_length():.2f}"
        )
    plain = next(iter(results.values()))
    for row in range(b):
        prompt = prompts[row, : lengths[row]].tolist()
        new = plain.tokens[row, : plain.lengths[row]].tolist()
        print(f"  prompt {prompt[:8]}{'...' if len(prompt) > 8 else ''} -> {new}")
    if rollout.temperature == 0:
        check(model, prompts, lengths, results)


def check(model, prompts, lengths, results) -> None:
    """Greedy: every run emits the same tokens, each the argmax of one training forward."""
    plain, *others = results.values()
    same = all(np.array_equal(o.tokens, plain.tokens) for o in others)
    argmax = all(
        check_row(model, prompts[r, : lengths[r]], plain.tokens[r, : plain.lengths[r]])
        for r in range(prompts.shape[0])
    )
    print(f"speculative equals plain: {'yes' if same else 'NO'}")
    print(f"greedy generation equals the argmax of the full forward: {'yes' if argmax else 'NO'}")
    if not (same and argmax):
        raise SystemExit(1)


def check_row(model, prompt, generated) -> bool:
    seq = jnp.concatenate([prompt, generated])[None]
    logits = model(seq)[0]
    predicted = jnp.argmax(logits[len(prompt) - 1 : -1], axis=-1)
    return bool(jnp.array_equal(predicted, generated))


if __name__ == "__main__":
    sys.exit(cli.run(main))
