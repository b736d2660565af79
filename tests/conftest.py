"""Tests run on the CPU with 8 virtual devices, so every mesh axis in use is exercised in CI."""

import os

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
