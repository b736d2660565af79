"""The Transformer: cache and branch paths agree with the full forward; sharded training agrees
with one device; the model refuses a mesh it does not fit.

Compilation dominates on CPU, so every test reuses one model and one padded length.
"""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import close, moved
from jax.ad_checkpoint import print_saved_residuals

from jspec.config import ConfigError, KernelConfig, MeshConfig, ModelConfig
from jspec.mesh import logical_spec, make_mesh, sharding
from jspec.models import KVCache, Transformer, create, param_shardings

CONFIG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_layers=3,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=128,
    qk_norm=True,
    tap_layers=(0, 1, 2),
)
PAD = 16  # every single-sequence forward runs at this length: one compilation


def graphdef_for(config, mesh=None):
    """The graphdef of a Transformer, without initialising one."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), mesh=mesh)))[0]


@pytest.fixture(scope="module")
def model():
    return create(CONFIG)


@pytest.fixture(scope="module")
def fns(model):
    """Jitted entry points over (state, ...), split/merge at the edge."""
    graphdef, state = nnx.split(model)
    m = lambda s: nnx.merge(graphdef, s)
    host = lambda f: lambda *a: jax.device_get(f(*a))  # index results in numpy, not eagerly
    padded = host(jax.jit(lambda s, t, seg: m(s)(t, seg, features="taps")))
    prefill = host(jax.jit(lambda s, t, c, n: m(s).prefill(t, c, n, features="taps")))
    decode = host(jax.jit(lambda s, t, c: m(s).decode(t, c, features="taps")))
    branch = host(jax.jit(lambda s, c, *a: m(s).branch_forward(c, *a, features="taps")))

    def forward(seq):
        """Logits [T,V] and taps [3,T,D] of one sequence, from the training forward."""
        n = len(seq)
        tok = np.zeros((1, PAD), np.int32)
        tok[0, :n] = seq
        logits, taps = padded(state, tok, (np.arange(PAD) < n).astype(np.int32)[None])
        return logits[0, :n], taps[:, 0, :n]

    return state, forward, prefill, decode, branch


def tokens(seed, n):
    return np.random.RandomState(seed).randint(0, CONFIG.vocab_size, n).astype(np.int32)


def test_prefill_then_decode_matches_forward(model, fns):
    state, forward, prefill, decode, _ = fns
    lengths = np.array([5, 9], np.int32)
    seqs = [tokens(1, 13), tokens(2, 13)]  # row b: prompt seqs[b][:lengths[b]], then decoded
    prompt = np.zeros((2, 9), np.int32)
    for b in range(2):
        prompt[b, : lengths[b]] = seqs[b][: lengths[b]]
    full = [forward(s) for s in seqs]

    logits, cache, taps = prefill(state, prompt, model.init_cache(2, PAD), lengths)
    for b in range(2):
        n = lengths[b]
        close(logits[b], full[b][0][n - 1])
        close(taps[:, b, :n], full[b][1][:, :n])
    np.testing.assert_array_equal(cache.length, lengths)
    np.testing.assert_array_equal(cache.segment_ids[0], [1] * 5 + [0] * 11)
    np.testing.assert_array_equal(cache.positions[1, :9], np.arange(9))
    for step in range(4):
        token = np.array([seqs[b][lengths[b] + step] for b in range(2)])
        logits, cache, taps = decode(state, token, cache)
        for b in range(2):
            t = lengths[b] + step
            close(logits[b], full[b][0][t])
            close(taps[:, b], full[b][1][:, t])
    np.testing.assert_array_equal(cache.length, lengths + 4)


def test_branch_forward_matches_root_to_node_paths(model, fns):
    state, forward, prefill, decode, branch = fns
    lengths = np.array([6, 4], np.int32)
    prompt = np.stack([tokens(3, 6), tokens(4, 6)])
    _, cache, _ = prefill(state, prompt, model.init_cache(2, PAD), lengths)

    # Node 0 is the root (the last sampled token, not cached); node 5 is padding (anchor -1).
    parent = np.array([-1, 0, 0, 1, 3, -1, 2], np.int32)
    depth = np.array([0, 1, 1, 2, 3, 0, 2], np.int32)
    node_tokens = np.stack([tokens(5, 7), tokens(6, 7)])
    node_tokens[:, 5] = -1
    anchor = np.repeat((lengths - 1)[:, None], 7, axis=1)  # every node hangs off the last slot
    anchor[:, 5] = -1
    positions = lengths[:, None] + depth[None]
    logits, k, v, taps = branch(
        state, cache, node_tokens, positions, anchor, np.broadcast_to(parent, (2, 7))
    )
    assert k.shape == v.shape == (3, 2, 7, 4, 8)
    assert np.isfinite(logits).all()

    def path(node):
        return [] if node == -1 else path(parent[node]) + [node]

    for b in range(2):
        for node in (0, 1, 2, 3, 4, 6):
            want_logits, want_taps = forward(
                np.concatenate([prompt[b, : lengths[b]], node_tokens[b, path(node)]])
            )
            close(logits[b, node], want_logits[-1])
            close(taps[:, b, node], want_taps[:, -1])

    # Writing the accepted path 0 -> 1 -> 3 into the cache, then decoding, continues that path.
    accepted = np.array([0, 1, 3])
    count = np.full((2,), 3, np.int32)
    cache = jax.jit(KVCache.append)(cache, k[:, :, accepted], v[:, :, accepted], count)
    nxt = np.array([7, 8], np.int32)
    logits, cache, _ = decode(state, nxt, cache)
    for b in range(2):
        seq = np.concatenate([prompt[b, : lengths[b]], node_tokens[b, accepted], nxt[b : b + 1]])
        close(logits[b], forward(seq)[0][-1])


def test_prefill_continues_the_documents_in_the_cache(model, fns):
    """Two prefills (chunked prompts), then a decode, read as one document per row."""
    state, forward, prefill, decode, _ = fns
    seqs = [tokens(11, 12), tokens(12, 12)]
    first, second = np.array([4, 2], np.int32), np.array([3, 6], np.int32)
    chunk = lambda start, n: np.stack(
        [np.pad(s[a : a + k], (0, 6 - k)) for s, a, k in zip(seqs, start, n, strict=True)]
    )
    _, cache, _ = prefill(state, chunk([0, 0], first), model.init_cache(2, PAD), first)
    logits, cache, taps = prefill(state, chunk(first, second), cache, second)
    total = first + second
    np.testing.assert_array_equal(cache.length, total)
    np.testing.assert_array_equal(cache.positions[1, : total[1]], np.arange(total[1]))
    for b in range(2):
        want, want_taps = forward(seqs[b][: total[b]])
        close(logits[b], want[-1])
        close(taps[:, b, : second[b]], want_taps[:, first[b] :])
    nxt = np.array([seqs[0][total[0]], seqs[1][total[1]]])
    logits, cache, _ = decode(state, nxt, cache)
    for b in range(2):
        close(logits[b], forward(seqs[b][: total[b] + 1])[0][-1])


def test_decode_on_an_empty_cache_starts_a_document(model, fns):
    state, forward, _, decode, _ = fns
    seq = tokens(13, 2)
    logits, cache, _ = decode(state, seq[:1].repeat(2), model.init_cache(2, PAD))
    close(logits[0], forward(seq[:1])[0][0])
    logits, cache, _ = decode(state, seq[1:].repeat(2), cache)
    close(logits[1], forward(seq)[0][-1])


def test_prefill_of_no_tokens_is_refused_or_nan(model, fns):
    state, _, prefill, *_ = fns
    prompt = np.stack([tokens(14, 6), tokens(15, 6)])
    with pytest.raises(ValueError, match=r"lengths\[1\]=0: every row needs at least one new token"):
        model.prefill(prompt, model.init_cache(2, PAD), np.array([3, 0], np.int32))
    logits, cache, _ = prefill(state, prompt, model.init_cache(2, PAD), np.array([3, 0], np.int32))
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()
    np.testing.assert_array_equal(cache.length, [3, 0])


def test_cache_overflow_is_refused_or_marked(model):
    cache = model.init_cache(2, 4)
    kv = jnp.zeros((CONFIG.num_layers, 2, 3, CONFIG.num_kv_heads, CONFIG.head_dim))
    cache = cache.append(kv, kv, jnp.array([3, 1]))
    with pytest.raises(ValueError, match=r"row 0 of the KV cache holds 3 of 4 slots and cannot"):
        cache.append(kv, kv, jnp.array([2, 2]))
    marked = jax.jit(KVCache.append)(cache, kv, kv, jnp.array([2, 2]))
    np.testing.assert_array_equal(marked.overflowed, [True, False])
    np.testing.assert_array_equal(marked.length, [4, 3])


def test_put_rows_moves_a_shorter_cache_into_the_first_slots(model):
    """A prefill's cache, as long as its prompts, replaces rows of a longer cache: its K/V in the
    first slots, the rest of the row emptied (segment 0) whatever it held; a row index past the
    last is dropped, the other rows are untouched."""
    shape = (CONFIG.num_layers, 3, 6, CONFIG.num_kv_heads, CONFIG.head_dim)
    full = model.init_cache(3, 8).append(jnp.ones(shape), jnp.ones(shape), jnp.array([6, 5, 4]))
    shape = (CONFIG.num_layers, 2, 2, CONFIG.num_kv_heads, CONFIG.head_dim)
    short = model.init_cache(2, 2).append(
        2 * jnp.ones(shape), 3 * jnp.ones(shape), jnp.array([2, 1])
    )
    put = jax.jit(KVCache.put_rows)(full, jnp.array([2, 3]), short)  # row 3: none, dropped
    np.testing.assert_array_equal(put.length, [6, 5, 2])
    np.testing.assert_array_equal(put.segment_ids[2], [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(put.positions[2, :2], [0, 1])
    np.testing.assert_array_equal(put.k[0][2, :, :2], 2)
    np.testing.assert_array_equal(put.v[-1][2, :, :2], 3)
    for old, new in zip(jax.tree.leaves(full), jax.tree.leaves(put), strict=True):
        np.testing.assert_array_equal(old[:2], new[:2])
    with pytest.raises(ValueError, match="rows of 8 slots do not fit a cache of 2 slots"):
        short.put_rows(jnp.array([0]), full)


def test_taps_are_layer_inputs(model, fns):
    _, forward, *_ = fns
    seq = tokens(7, 8)
    _, taps = forward(seq)
    assert taps.shape == (3, 8, 64)
    np.testing.assert_array_equal(taps[0], model.embed[...][seq])  # tap layer 0: embeddings


def test_final_feature_is_what_the_head_reads_on_every_path(model):
    """features="final": the final-normed hidden state, the same from the training forward, a
    prefill and a branch forward, and the logits are the output head applied to it."""
    seq = tokens(8, 6)
    logits, final = model(seq[None], features="final")
    assert final.shape == (1, 1, 6, CONFIG.hidden_size)
    close(logits, jnp.einsum("btd,vd->btv", final[0], model.head[...]))
    _, cache, prefilled = model.prefill(seq[None, :4], model.init_cache(1, PAD), features="final")
    close(prefilled, final[:, :, :4])
    parent = np.array([[-1, 0]], np.int32)
    branched = model.branch_forward(
        cache, seq[None, 4:], np.array([[4, 5]]), np.array([[3, 3]]), parent, features="final"
    )[3]
    close(branched, final[:, :, 4:])
    with pytest.raises(
        ValueError, match=r"features='hidden' is not one of \(None, 'taps', 'final'\)"
    ):
        model(seq[None], features="hidden")


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_rollout_on_a_mesh_matches_one_device(model, fns, backend):
    """Rows split over data x context (extra data parallelism in rollout), heads over tensor; the
    cache part of attention in XLA, or in the Pallas kernel (interpreted) inside `shard_map`; the
    weights as the rollout loop has them (`for_rollout`: per layer, products fused)."""
    kernels = KernelConfig(decode_backend=backend)
    state, forward, *_ = fns
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    graphdef = graphdef_for(model.config, mesh)
    m = lambda s: nnx.merge(graphdef, s).for_rollout()
    sharded = jax.device_put(state, param_shardings(state, mesh))
    cache = m(sharded).init_cache(4, PAD)
    names = ("decode_batch", "act_kv_heads", None, None)
    assert all(k.sharding.spec == logical_spec(names) for k in cache.k)
    seqs = np.random.RandomState(8).randint(0, CONFIG.vocab_size, (4, 9)).astype(np.int32)
    lengths = np.array([8, 5, 3, 6], np.int32)
    prompt = np.where(np.arange(8) < lengths[:, None], seqs[:, :8], 0)
    nxt = seqs[np.arange(4), lengths]
    _, cache = jax.jit(lambda s, *a: m(s).prefill(*a, kernels=kernels))(
        sharded, prompt, cache, lengths
    )
    got, cache = jax.jit(lambda s, *a: m(s).decode(*a, kernels=kernels))(sharded, nxt, cache)
    assert all(k.sharding.is_equivalent_to(sharding(mesh, names), 4) for k in cache.k)
    for b in range(4):
        close(got[b], forward(seqs[b, : lengths[b] + 1])[0][-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_for_rollout_computes_what_the_model_computes(model, fns, dtype):
    """The unstacked copy of the rollout loop, its products fused, its input norms folded into
    them and its float32 weights cast to the compute dtype once: the same prefill and decode (of
    the same token) to the compute dtype's rounding, the original left stacked. Its norms are
    moved off 1, so that each (input norms folded, q and k norms joined) is tested."""
    state = moved(fns[0], seed=4)
    graphdef = graphdef_for(dataclasses.replace(CONFIG, dtype=dtype))
    prompt = np.random.RandomState(9).randint(0, CONFIG.vocab_size, (2, 6)).astype(np.int32)
    token = np.array([3, 7], np.int32)

    def run(state, rollout: bool):
        m = nnx.merge(graphdef, state)
        m = m.for_rollout() if rollout else m
        logits, cache = m.prefill(prompt, m.init_cache(2, PAD))
        return logits, m.decode(token, cache)[0]

    run = jax.jit(run, static_argnums=1)
    rtol = 1e-5 if dtype == "float32" else 2e-2
    for got, want in zip(run(state, True), run(state, False), strict=True):
        close(got, want, rtol=rtol)
    rollout = jax.jit(lambda s: nnx.state(nnx.merge(graphdef, s).for_rollout()))(state)
    stacks = {"layers", "moe_layers"}  # left as they are, unused by the rollout path
    kept = [x for path, x in jax.tree.leaves_with_path(rollout) if path[0].key not in stacks]
    assert {x.dtype for x in kept if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(dtype)}
    original = nnx.merge(graphdef, state)
    original.for_rollout()
    assert original.embed[...].dtype == original.final_norm[...].dtype == jnp.float32
    assert model.unstacked is None
    layer, c = model.for_rollout().unstacked[2], CONFIG
    g = c.num_heads // c.num_kv_heads
    # Outputs first (`fuse_products`): q/k/v fused, gate and up stacked, wo and w_down transposed.
    d, e, f = c.hidden_size, c.head_dim, c.intermediate_size
    assert layer.wq is None and layer.w_qkv.shape == (c.num_kv_heads, g + 2, e, d)
    assert layer.wo.shape == (d, c.num_heads, e)
    assert layer.w_gate_up.shape == (2, f, d) and layer.w_down.shape == (d, f)


# ---------------------------------------------------------------------------------------------
# Training forward: sharding and remat change nothing.


def packed_batch(b, t, seed=0):
    """Rows of two documents each (segment ids 1, 2), positions restarting, a padded tail."""
    rng = np.random.RandomState(seed)
    tok = rng.randint(0, CONFIG.vocab_size, (b, t)).astype(np.int32)
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for r in range(b):
        cut, end = rng.randint(2, t - 4), rng.randint(t - 3, t + 1)
        seg[r, :cut], seg[r, cut:end] = 1, 2
        pos[r, :cut], pos[r, cut:end] = np.arange(cut), np.arange(end - cut)
    return tok, seg, pos


def loss_fn(graphdef):
    """Mean next-token cross-entropy within documents, plus the weighted router loss (0: dense)."""

    def loss(state, tok, seg, pos):
        model = nnx.merge(graphdef, state)
        logits, aux = model(tok, seg, pos, aux_loss=True)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1)[..., 0]
        mask = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
        return jnp.sum(nll * mask) / jnp.sum(mask) + model.config.router_aux_loss_coef * aux

    return loss


BATCH = packed_batch(8, PAD)


@pytest.fixture(scope="module")
def reference(model):
    """Loss and gradients on one device, remat 'full'."""
    graphdef, state = nnx.split(model)
    return jax.jit(jax.value_and_grad(loss_fn(graphdef)))(state, *BATCH)


def assert_sharded_matches(model, mesh, batch, want, grad_rtol=1e-4):
    """Loss and gradients with parameters and rows placed on `mesh` equal `want` (one device)."""
    state = nnx.state(model)
    state = jax.device_put(state, param_shardings(state, mesh))
    rows = sharding(mesh, ("batch", None))
    step = jax.jit(jax.value_and_grad(loss_fn(graphdef_for(model.config, mesh))))
    loss, grad = step(state, *(jax.device_put(x, rows) for x in batch))
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    jax.tree.map(lambda g, w: close(g, w, grad_rtol), grad, want[1])
    return grad


@pytest.mark.parametrize("shape", [dict(data=2, tensor=4), dict(data=8)])
def test_sharded_train_forward_matches_one_device(model, reference, shape):
    mesh = make_mesh(MeshConfig(**shape))
    grad = assert_sharded_matches(model, mesh, BATCH, reference)
    w_up = grad["layers"]["w_up"][...]
    assert w_up.sharding.is_equivalent_to(sharding(mesh, ("layers", "embed", "mlp")), 3)


def test_context_parallel_train_forward_matches_one_device(model):
    """data=2, context=2, tensor=2: the ring over zigzag rows gives one device's loss and grads."""
    b, t = 4, PAD
    rng = np.random.RandomState(1)
    tok = rng.randint(0, CONFIG.vocab_size, (b, t)).astype(np.int32)
    seg = np.asarray(
        [[1] * 8 + [2] * 4 + [0] * 4, [1] * 16, [1] * 4 + [2] * 12, [1] * 12 + [0] * 4]
    )
    starts = [[list(r).index(x) for x in r] for r in seg]  # first index of each token's segment
    pos = (np.arange(t) - np.asarray(starts)).astype(np.int32)
    batch = (tok, seg.astype(np.int32), pos)
    graphdef, state = nnx.split(model)
    want = jax.jit(jax.value_and_grad(loss_fn(graphdef)))(state, *batch)
    assert_sharded_matches(model, make_mesh(MeshConfig(data=2, context=2, tensor=2)), batch, want)


def test_context_parallel_misaligned_document_gives_nan(model):
    """Under jit the ids are abstract: a document not a multiple of 2 * cp poisons the logits."""
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    seg = np.asarray([[1] * 6 + [2] * 10] * 2, np.int32)  # 6 is not a multiple of 4
    pos = np.asarray([list(range(6)) + list(range(10))] * 2, np.int32)
    tok = np.zeros((2, PAD), np.int32)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, *x: nnx.merge(graphdef_for(CONFIG, mesh), s)(*x))
    assert jnp.all(jnp.isnan(forward(state, tok, seg, pos)))


def test_cache_longer_than_the_model_is_refused(model):
    with pytest.raises(ConfigError, match=r"cache of 5000 slots exceeds model.max_seq_len=4096"):
        model.init_cache(1, 5000)


def test_remat_dots_agrees_with_full(model, reference):
    graphdef = graphdef_for(dataclasses.replace(CONFIG, remat="dots"))
    loss, grad = jax.jit(jax.value_and_grad(loss_fn(graphdef)))(nnx.state(model), *BATCH)
    np.testing.assert_allclose(loss, reference[0], rtol=1e-6)
    jax.tree.map(lambda g, w: close(g, w, 1e-5), grad, reference[1])


@pytest.mark.parametrize("remat, kept", [("dots", True), ("full", False)])
def test_remat_dots_keeps_attentions_output_for_the_backward(model, remat, kept):
    """Under 'dots' the backward reads attention's log-sum-exp (layers x rows x tokens x heads)
    saved by the forward, with its output, rather than running the attention forward again."""
    graphdef = graphdef_for(dataclasses.replace(CONFIG, remat=remat))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss_fn(graphdef), nnx.state(model), *BATCH)
    lse = f"f32[{CONFIG.num_layers},{len(BATCH[0])},{PAD},{CONFIG.num_heads}] output of scan"
    assert (lse in printed.getvalue()) == kept


def test_bfloat16_compute_close_to_float32(model, reference):
    graphdef = graphdef_for(dataclasses.replace(CONFIG, dtype="bfloat16"))
    loss = jax.jit(loss_fn(graphdef))(nnx.state(model), *BATCH)
    np.testing.assert_allclose(loss, reference[0], rtol=2e-2)


def test_create_places_parameters_on_the_mesh(model):
    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    sharded = create(CONFIG, mesh=mesh)
    assert sharded.mesh is mesh
    assert sharded.layers.wq[...].sharding.spec == logical_spec(
        ("layers", "embed", "heads", "head_dim")
    )
    assert sharded.embed[...].sharding.spec == logical_spec(("vocab", "embed"))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(sharded), nnx.state(model))


@pytest.mark.parametrize(
    "field, value", [("num_kv_heads", 2), ("vocab_size", 250), ("intermediate_size", 126)]
)
def test_model_that_does_not_fit_the_tensor_axis_is_refused(field, value):
    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    config = dataclasses.replace(CONFIG, **{field: value})
    with pytest.raises(
        ConfigError, match=rf"model\.{field}={value} is not divisible by 4.*mesh\.tensor"
    ):
        Transformer(config, rngs=nnx.Rngs(0), mesh=mesh)
