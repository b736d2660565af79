"""Tests run on the CPU with 8 virtual devices, so every mesh axis in use is exercised in CI."""

import gc
import os
from pathlib import Path

import pytest

# Compiling dominates the tests' time on the CPU (tiny shapes, hundreds of programs): LLVM's
# optimizations halve it or better, and the tests' properties do not depend on them.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {FAST_COMPILE} --xla_force_host_platform_device_count=8"
).strip()


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory) -> str:
    """One persistent XLA compilation cache for the RL loop's runs, shared by the test files (and
    the pytest-xdist workers) of a session: what one file compiled, another loads."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root
    (root / "jax_cache").mkdir(exist_ok=True)
    return str(root / "jax_cache")


def _memory_map_limit() -> int | None:
    path = Path("/proc/sys/vm/max_map_count")
    return int(path.read_text()) if path.exists() else None


_MAP_LIMIT = _memory_map_limit()


@pytest.fixture(autouse=True)
def _unmap_compiled_programs():
    """XLA's CPU backend maps each compiled program's code into memory regions of its own (tens a
    program) until its cache lets go: a worker that compiles a few thousand programs passes the
    kernel's limit (`vm.max_map_count`, 65530 by default) and its next compile aborts the process.
    Past half the limit, dropping JAX's caches between tests unmaps them."""
    yield
    if _MAP_LIMIT is None:
        return
    with open("/proc/self/maps") as maps:
        count = sum(1 for _ in maps)
    if count > _MAP_LIMIT // 2:
        import jax

        jax.clear_caches()
        gc.collect()
