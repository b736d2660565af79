"""The greedy check of the rollout path: greedy tokens of `jspec.sampler.generate` (plain, and
through the draft's trees) against a step-by-step loop of the model's own `prefill` and `decode`,
in float32. `jspec.bench.rollout --check-greedy` runs it before it times anything.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.attention.decode import attention_backend
from jspec.bench.timing import log
from jspec.config import KernelConfig, RolloutConfig, TreeConfig
from jspec.sampler import compile_generate, generate


def check_greedy(
    model,
    draft,
    prompt_rows,
    trees: dict[str, TreeConfig],
    args,
    batch: int = 4,
    new_tokens: int = 32,
) -> None:
    """Raises unless the greedy tokens of `generate` (plain, and with the draft through every tree
    of `trees`) equal those of a step-by-step loop of `prefill` and `decode` (no `for_rollout`, the
    cache part of attention in XLA, not the Pallas kernel, the products not fused) on the first
    `batch` prompts. The models are float32, the products in full precision
    (not TF32) on both sides. With `--trained`, drafts are accepted, so the acceptance walk and the
    accepted path's move into the cache are checked too; each tree's accepted tokens are logged.
    The loops compile `--compile-threads` at a time."""
    prompts = jnp.asarray(np.resize(prompt_rows, (batch, args.prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)
    highest = lambda: jax.default_matmul_precision("highest")  # a thread's own setting
    log(f"greedy check: {batch} x {new_tokens} tokens, float32; the step-by-step loop")
    with highest():
        expected = step_by_step_greedy(model, prompts, new_tokens)
    loops = {"plain": (None, TreeConfig()), **{k: (draft, tree) for k, tree in trees.items()}}
    key = jax.random.key(0)
    config = lambda tree: RolloutConfig(max_new_tokens=new_tokens, temperature=0.0, tree=tree)

    def compiled(loop):
        with highest():
            compile_generate(model, loop[0], prompts, lengths, key, config(loop[1]))

    log(f"greedy check: compiling {', '.join(loops)}")
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        list(pool.map(compiled, loops.values()))
    log("greedy check: compiled; running")
    for name, (d, tree) in loops.items():
        with highest():
            got = generate(model, d, prompts, lengths, key, config(tree))
        if not np.array_equal(np.asarray(got.tokens), expected):
            raise SystemExit(f"greedy check: {name} differs from the step-by-step loop")
        accepted, steps = float(got.stats.accepted.sum()), float(got.stats.steps.sum())
        log(
            f"greedy check: {name} equal; {accepted:.0f} drafted tokens accepted in {steps:.0f} "
            "verify steps"
        )
    backend = attention_backend(config(TreeConfig()).kernels.decode_backend, model.config.head_dim)
    log(
        f"greedy check: {', '.join(loops)} (cache attention: {backend}) equal the step-by-step "
        f"loop (XLA; {batch} x {new_tokens} tokens, float32)"
    )


def step_by_step_greedy(model, prompts, new_tokens: int) -> np.ndarray:
    """[B, new_tokens] greedy tokens of the model's own `prefill`, then `decode` one token at a
    time, the cache part of attention in XLA. It is the reference, so it compiles without XLA's
    search of GEMM tilings on the GPU: its speed does not matter."""
    batch, t = prompts.shape
    graphdef, state = nnx.split(model)
    m = lambda state: nnx.merge(graphdef, state)
    no_search = {"xla_gpu_autotune_level": 0}
    untuned = lambda f, *args: jax.jit(f).lower(state, *args).compile(compiler_options=no_search)
    xla = KernelConfig(decode_backend="xla")
    start = time.perf_counter()
    cache = model.init_cache(batch, t + new_tokens)
    prefill = untuned(lambda s, c: m(s).prefill(prompts, c, kernels=xla), cache)
    token = jax.ShapeDtypeStruct((batch,), jnp.int32)
    decode = untuned(lambda s, tok, c: m(s).decode(tok, c, kernels=xla), token, cache)
    log(f"greedy check: the step-by-step loop compiled in {time.perf_counter() - start:.0f} s")
    logits, cache = prefill(state, cache)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(jnp.argmax(logits, axis=-1))
        logits, cache = decode(state, tokens[-1], cache)
    return np.stack(jax.device_get(tokens), axis=1)
