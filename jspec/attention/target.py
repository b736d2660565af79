"""The device attention's 'auto' picks kernels for.

That is this process's first device, except while a program is compiled ahead of time for other
hardware: a CPU host that compiles a GPU program from a GPU's description (`jspec.jobs.plan
--gpu-target`) wants the Pallas GPU kernels the GPU would run, which its own backend cannot run.
`compiling_for(mesh)` says so for the code it wraps (its tracing and lowering).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_DEVICE = contextvars.ContextVar("jspec_attention_target", default=None)


def device():
    """The device programs are traced for: the one `compiling_for` set, else this process's first
    (None where jax has no backend)."""
    if (given := _DEVICE.get()) is not None:
        return given
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def platform() -> str | None:
    """'gpu', 'tpu' or 'cpu' (jax's names; CUDA and ROCm devices are 'gpu') of `device()`."""
    d = device()
    return None if d is None else d.platform


@contextlib.contextmanager
def compiling_for(mesh: jax.sharding.Mesh):
    """Within it, `device()` is the first of `mesh`'s devices (e.g. compile-only ones of a
    topology), and `mesh` is jax's abstract mesh, whose device kind the Pallas GPU lowering reads
    where the process has no such GPU."""
    token = _DEVICE.set(mesh.devices.flat[0])
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield
    finally:
        _DEVICE.reset(token)
