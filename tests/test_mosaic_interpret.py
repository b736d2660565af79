"""The Mosaic GPU kernel's forward on the CPU, in jax's GPU interpret mode (jax 0.11 or later: the
warp groups run as threads, shared memory, barriers and TMA copies are simulated), against the
reference attention: its barriers, rings and plans are checked without a GPU. Three things the
interpreter does not do are supplied here: `pl.run_state` (the kernel's accumulators given
initial values: run from zero, the initial values added after), a wgmma whose left operand is in
registers (acc += a @ b, b read from shared memory), and a barrier freed with phases its copy
group never waited for (the kernel copies nothing after its last tiles, so it does not wait for
their release). The backward does not run in the interpreter (its dQ's reduce-add copy is not
interpreted; with one supplied, it waits forever on a barrier), and races are not checked: the
interpreter reports the masked tiles' ids, read by `plgpu.load` before the release that orders
them, as racing with the next copy into their slot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.attention import mosaic_gpu, reference_attention

if jax.__version_info__ < (0, 11):
    pytest.skip("the Mosaic GPU kernel's interpret mode needs jax >= 0.11", allow_module_level=True)
from jax._src import callback  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, shared_memory  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as interpret  # noqa: E402
from jax._src.state import types as state_types  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402


def run_state(body):
    def run(init):
        inits = init if isinstance(init, tuple) else (init,)

        def scoped(*refs):
            body(refs if isinstance(init, tuple) else refs[0])
            return tuple(r[...] for r in refs)

        outs = pl.run_scoped(scoped, *(plgpu.ACC(x.shape, x.dtype) for x in inits))
        outs = tuple(x._init + o for x, o in zip(inits, outs, strict=True))
        return outs if isinstance(init, tuple) else outs[0]

    return run


@gpu_callbacks.fail_on_exception
def wgmma_from_registers(*, token, mesh_location, thread, acc, acc_at, a, b, b_at, source_info):
    memory = gpu_callbacks._get_shared_memory()
    info = shared_memory.GPULoggingInfo(mesh_location, thread, source_info)
    acc, b = (gpu_callbacks.HostAllocationKey.from_array(x) for x in (acc, b))
    at = [jax.tree.map(int, gpu_callbacks._remove_noop_transforms(t)) for t in (acc_at, b_at)]
    b_value, _, _ = memory.get_buffer_content(b, memory.access(b, at[1]), thread, logging_info=info)
    where = memory.access(acc, at[0])
    value, _, _ = memory.get_buffer_content(acc, where, thread, logging_info=info)
    value = value + np.matmul(np.asarray(a), b_value, dtype=value.dtype)
    memory.store_buffer_content(acc, where, value, thread, logging_info=info)
    return token


def wgmma_rule(interpreted_rule):
    def rule(self, eqn, token, get_invals):
        if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
            return interpreted_rule(self, eqn, token, get_invals)
        acc, a, b, *leaves = get_invals()
        names = ("acc", "a", "b")
        trees = [eqn.params[f"{x}_transforms_tree"] or jax.tree.structure([]) for x in names]
        acc_at, _, b_at = jax.tree.unflatten(jax.tree_util.treedef_tuple(trees), leaves)
        acc, acc_at = interpret.resolve_ref(eqn.invars[0].aval, acc, acc_at)
        b, b_at = interpret.resolve_ref(eqn.invars[2].aval, b, b_at)
        call = functools.partial(wgmma_from_registers, source_info=eqn.source_info)
        token = callback.io_callback(
            call, gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, thread=self.thread,
            mesh_location=self.mesh_location, acc=acc, acc_at=acc_at, a=a, b=b, b_at=b_at,
        )  # fmt: skip
        return token, []

    return rule


def free_barrier(self):
    with self.cv:
        self.ref_count -= 1
        assert self.ref_count > 0 or self.arrivals_count == 0, "a barrier freed mid-phase"


@pytest.fixture
def interpreted(monkeypatch):
    """The Mosaic GPU kernels run in jax's GPU interpret mode within the test."""
    [interpreter] = [c for c in vars(interpret).values() if hasattr(c, "_interpret_wgmma_ref_p")]
    monkeypatch.setattr(pl, "run_state", run_state)
    rule = wgmma_rule(interpreter._interpret_wgmma_ref_p)
    monkeypatch.setattr(interpreter, "_interpret_wgmma_ref_p", rule)
    monkeypatch.setattr(shared_memory.Barrier, "deallocate", free_barrier)
    with plgpu.force_gpu_interpret_mode():
        yield
    jax.clear_caches()  # no interpreted kernel stays in jit's caches


@pytest.mark.parametrize(
    "head_dim, heads, lengths",
    [(64, (2, 1), (100, 450, 474)), (128, (4, 2), (64,) * 4 + (200, 300, 268))],
)
def test_the_mosaic_forward_matches_the_reference(interpreted, head_dim, heads, lengths):
    """Packed documents, GQA, fresh (the kernel's own outputs) and continued over a second half
    of the keys (a ring's two steps), within bfloat16's error of the reference."""
    rng = np.random.default_rng(0)
    t, (hq, hkv) = sum(lengths), heads
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, t, h, head_dim)), jnp.bfloat16) for h in (hq, hkv, hkv)
    )
    seg = jnp.asarray(np.repeat(np.arange(1, len(lengths) + 1), lengths)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    f32 = lambda x: x.astype(jnp.float32)
    want = np.asarray(reference_attention(f32(q), f32(k), f32(v), seg, pos))
    fwd = functools.partial(mosaic_gpu.fwd, scale=head_dim**-0.5)
    fresh, _ = fwd(q, k, v, seg, pos, seg, pos, out_dtype=jnp.float32)
    h = t // 2
    first = fwd(q, k[:, :h], v[:, :h], seg, pos, seg[:, :h], pos[:, :h])
    continued, _ = fwd(q, k[:, h:], v[:, h:], seg, pos, seg[:, h:], pos[:, h:], first)
    for got in (fresh, continued):
        assert np.abs(np.asarray(got) - want).max() < 1e-2
