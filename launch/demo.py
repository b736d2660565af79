"""CPU demo: a small Qwen3-style model generates with its KV cache, and checks itself.

    python launch/demo.py                       # configs/demo.yaml, random weights
    python launch/demo.py --config tiny model.num_layers=12 --new-tokens 64
    python launch/demo.py --checkpoint /path/to/hf/qwen3   # a Hugging Face checkpoint directory

Prefill and decode run in one jitted program (decode steps through the layers unrolled, as the
sampler does). With greedy decoding the demo then re-reads prompt + generation in one training
forward and checks that every generated token is that forward's argmax: the cache path and the
training path agree.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import config as config_lib
from jspec.models import create, hf
from jspec.spec import sample


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=12")
    p.add_argument("--config", default="demo", help="config name in configs/ or a YAML path")
    p.add_argument("--checkpoint", default=None, help="Hugging Face checkpoint directory")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (and checked)")
    return p.parse_args(argv)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature"))
def generate(graphdef, state, prompts, lengths, key, *, steps, temperature):
    """Prefill the prompts, then `steps` decode steps; returns the new tokens [B, steps]."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(prompts.shape[0], prompts.shape[1] + steps)
    logits, cache = model.prefill(prompts, cache, lengths)

    def step(carry, key):
        logits, cache = carry
        token = sample(key, logits, temperature=temperature)
        logits, cache = model.decode(token, cache)
        return (logits, cache), token

    _, tokens = jax.lax.scan(step, (logits, cache), jax.random.split(key, steps))
    return tokens.T


def main(argv=None):
    args = parse_args(argv)
    if args.checkpoint:
        model = hf.load(args.checkpoint)
        seed = 0
    else:
        cfg = config_lib.load(args.config, args.overrides)
        model = create(cfg.model, seed=cfg.seed)
        seed = cfg.seed
    c = model.config
    print(
        f"model: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/"
        f"{c.num_kv_heads}, vocab {c.vocab_size}, on {jax.devices()[0].platform}"
    )
    rng = np.random.default_rng(seed)
    b, t = args.batch, args.prompt_len
    prompts = jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32)  # ragged prompts
    prompts = jnp.where(jnp.arange(t) < lengths[:, None], prompts, 0)

    graphdef, state = nnx.split(model)
    run = functools.partial(
        generate,
        graphdef,
        state,
        prompts,
        lengths,
        steps=args.new_tokens,
        temperature=args.temperature,
    )
    start = time.perf_counter()
    tokens = jax.block_until_ready(run(jax.random.key(seed)))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = jax.block_until_ready(run(jax.random.key(seed + 1)))
    run_s = time.perf_counter() - start
    print(f"compiled in {compile_s:.1f} s; {b * args.new_tokens / run_s:,.0f} tokens/s after")
    for row in range(b):
        prompt = prompts[row, : lengths[row]].tolist()
        print(f"  prompt {prompt[:8]}{'...' if len(prompt) > 8 else ''} -> {tokens[row].tolist()}")

    if args.temperature == 0:
        ok = all(check_row(model, prompts[r, : lengths[r]], tokens[r]) for r in range(b))
        print(f"greedy generation equals the argmax of the full forward: {'yes' if ok else 'NO'}")
        if not ok:
            raise SystemExit(1)


def check_row(model, prompt, generated) -> bool:
    """Every generated token is the argmax of one training forward over prompt + generation."""
    seq = jnp.concatenate([prompt, generated])[None]
    logits = model(seq)[0]
    predicted = jnp.argmax(logits[len(prompt) - 1 : -1], axis=-1)
    return bool(jnp.array_equal(predicted, generated))


if __name__ == "__main__":
    main()
