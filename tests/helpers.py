"""Helpers shared by the tests: one error measure, one goodness-of-fit test, the test drafts, the
RL demo loop at test size, HLO collectives."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.scipy.special import gammaincc

from jspec.jobs import train_rl, trainer
from jspec.models.block import BlockConfig, BlockDraft, create_block
from jspec.models.draft import Shared
from jspec.rl.draft_loss import block_passes, draft_passes


def close(got, want, rtol=1e-5):
    """Max abs difference within rtol of the scale (max abs) of `want`."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= rtol * scale, f"max abs diff {err} > {rtol} * {scale}"


def close_trees(got, want, rtol=1e-5):
    """`close` leaf by leaf, for pytrees of one structure."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        close(a, b, rtol)


def chi_square_p_value(codes, joint) -> float:
    """Pearson's test of the observed codes against `joint`; cells expecting < 5 are pooled, and
    a draw in a cell of probability 0 fails outright."""
    observed = np.bincount(np.asarray(codes), minlength=joint.size).astype(np.float64)
    if observed[joint == 0].sum() > 0:
        return 0.0
    expected = observed.sum() * joint
    big = expected >= 5
    observed = np.append(observed[big], observed[~big & (joint > 0)].sum())
    expected = np.append(expected[big], expected[~big & (joint > 0)].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    stat = np.sum((observed - expected) ** 2 / expected)
    return float(gammaincc((expected.size - 1) / 2, stat / 2))


def moved(state, seed: int, names: tuple[str, ...] = ("norm",), scale: float = 0.3):
    """`state` with each leaf whose path names one of `names` moved by normal noise of `scale`:
    a norm's weight off its start of 1 (or an output off its zero start), so a test sees it."""
    leaves = jax.tree.leaves(state)
    key = iter(jax.random.split(jax.random.key(seed), len(leaves)))

    def move(path, x):
        hit = any(name in str(path) for name in names)
        return x + scale * jax.random.normal(next(key), x.shape) if hit else x

    return jax.tree_util.tree_map_with_path(move, state)


def noisy_copy(model, scale: float, seed: int = 0):
    """The model with Gaussian noise of `scale` times each parameter's RMS added to it: a draft
    that agrees with the model only in part."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        w + scale * jnp.sqrt(jnp.mean(w * w)) * jax.random.normal(k, w.shape, w.dtype)
        for w, k in zip(leaves, keys, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def chained_block(model, block_size: int, mesh=None, seed: int = 1) -> BlockDraft:
    """A random block draft of `model` with the chained head, its output moved away from its
    zero start (where the head would change nothing and its input would get no gradient)."""
    config = BlockConfig.for_target(model, block_size, chained=True)
    draft = create_block(config, mesh=mesh, seed=seed)
    noise = jax.random.normal(jax.random.key(seed), draft.chain_out.shape)
    draft.chain_out[...] = draft.chain_out[...] + noise * model.hidden_size**-0.5
    return draft


def distill_draft(target, draft, sequences, lengths, steps: int, learning_rate: float = 1e-2):
    """Trains a draft on the target's greedy choices over `sequences` (right-padded rows of
    `lengths` tokens), by the draft loss's own passes: a one-layer draft's first step (EAGLE-3 or
    an MTP head: position t, the target's features at t with the embedding of token t + 1, learns
    the target's argmax at t + 1, by `draft_passes`), or every position k = 1, 2, ... of a block
    draft's block after t (the target's argmax at t + k, by `block_passes`). Returns the trained
    draft."""
    b, t = sequences.shape
    seg = (jnp.arange(t) < jnp.asarray(lengths)[:, None]).astype(jnp.int32)
    forward = jax.jit(lambda x, s: target(x, s, features=draft.features))
    logits, features = forward(sequences, seg)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    shared = Shared.of(target)
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    optimizer = optax.adam(learning_rate)

    def loss(params, logits, features):  # the target's outputs as arguments: XLA folds constants
        d = nnx.merge(graphdef, params, rest)
        if isinstance(d, BlockDraft):
            passes = block_passes(d, shared, features, sequences, seg, pos)
        else:
            passes = draft_passes(d, shared, features, sequences, seg, pos, steps=0)
        total = 0.0
        for i, hidden in enumerate(passes):  # pass i at t: the target's choice at t + 1 + i
            labels = jnp.argmax(jnp.roll(logits, -1 - i, axis=1), axis=-1)
            mask = (seg * jnp.roll(seg, -1 - i, axis=1)).astype(bool) & (jnp.arange(t) < t - 1 - i)
            full = d.to_target_vocab(d.draft_logits(hidden, shared))
            nll = -jnp.take_along_axis(jax.nn.log_softmax(full), labels[..., None], -1)[..., 0]
            total = total + jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)
        return total

    @jax.jit
    def step(params, opt_state, logits, features):
        grads = jax.grad(loss)(params, logits, features)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, logits, features)
    return nnx.merge(graphdef, params, rest)


def count_dots(jaxpr) -> int:
    """dot_general operations a jaxpr runs: nested jaxprs included, scan bodies times their
    length (so a layer stack counts each layer however the scan is cut)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    total += times * count_dots(sub)
    return total


def random_rollouts(rows: int, prompt_len: int, new: int, vocab: int, seed: int = 0):
    """Right-padded prompts and responses of mixed lengths, sampler log-probs and advantages, as
    `jspec.rl.packing.pack` takes them."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, (rows, prompt_len)).astype(np.int32)
    prompt_lengths = rng.integers(2, prompt_len + 1, rows).astype(np.int32)
    responses = rng.integers(1, vocab, (rows, new)).astype(np.int32)
    response_lengths = rng.integers(1, new + 1, rows).astype(np.int32)
    logprobs = -rng.random((rows, new)).astype(np.float32)
    advantages = rng.normal(size=rows).astype(np.float32)
    return prompts, prompt_lengths, responses, response_lengths, logprobs, advantages


# The RL demo loop (jspec/jobs/train_rl.py) at test size.

LOOP = (
    "model.hidden_size=32 model.num_layers=3 model.head_dim=8 model.intermediate_size=64 "
    "rl.task.name=sorting rl.task.difficulty=1 rollout.max_new_tokens=6 "
    "rl.prompts=8 rl.group_size=8 rl.sequences_per_row=2 rl.sft_batch=16 "
    "rl.ttt_steps=1 rl.loss_chunk=16 rl.save_every=1 rl.learning_rate=2e-4"
).split()
COMPARED = ("reward", "policy_loss", "draft_loss", "accepted_length", "agreement")


def loop(run_dir, cache, *extra) -> list[dict]:
    """The metrics of a `train_rl` run of LOOP and `extra` (overrides and flags) in `run_dir`,
    finished or stopped at a limit (`--stop-after-steps N`, the warm start's steps counted: its
    exit status is EXIT_RESUME)."""
    args = [*LOOP, *extra, "--run-dir", str(run_dir), "--compilation-cache", cache, "--quiet"]
    try:
        train_rl.main(args)
    except SystemExit as stop:  # only at the limit it was given
        if stop.code != trainer.EXIT_RESUME or "--stop-after-steps" not in extra:
            raise
    path = pathlib.Path(run_dir) / "metrics.jsonl"  # none while the warm start is not done
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def collective_lines(hlo: str, op: str) -> list[str]:
    """The `op` instructions ('collective-permute', 'all-gather', ...) of compiled HLO text, each
    as '<result type> <source-target pairs or replica groups>', sorted (names, ids dropped)."""
    out = []
    for line in hlo.splitlines():
        kind = re.search(rf"= (.*?) {op}(?:-start)?\(", line)
        if kind is None:
            continue
        peers = re.search(r"(?:source_target_pairs|replica_groups)=([^ ]+?)(?:, |$)", line)
        out.append(f"{kind.group(1)} {peers.group(1) if peers else ''}")
    return sorted(out)
