"""The devices a plan compiles for, and the memory it is judged by: virtual CPU devices (the CPU
estimate), this machine's GPUs, compile-only GPUs of a cluster (of the local GPU's kind, or of a
description XLA publishes, with no GPU at all), or a TPU slice's chips (libtpu, on the CPU). Every
choice is checked before anything compiles (`jspec.jobs.plan`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import re

import jax

from jspec import config as config_lib
from jspec import mesh as mesh_lib
from jspec.config import ConfigError

GB = 1e9
H200_GB = 141.0  # the CPU estimate's default device memory
# HBM per chip by the device kind libtpu reports. Google states these in GiB; read as GB (10^9
# bytes, as the report counts) the verdict errs on the safe side by about 7%.
CHIP_GB = {"TPU v4": 32.0, "TPU v5": 95.0, "TPU v5 lite": 16.0, "TPU v6 lite": 32.0}
TOPOLOGIES = "v5p:4x4x4, v4:2x2x2, v5e:4x4, v6e:4x4"  # examples of the spelling libtpu accepts
# GPUs as XLA describes them (GpuTargetConfigProto text), for compiling without one: --gpu-target.
GPU_TARGETS = {p.stem: p for p in (pathlib.Path(__file__).parent / "gpu_targets").glob("*.txtpb")}
# The share of a GPU's memory jax's allocator takes by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_MEMORY_FRACTION = 0.75


def topology_devices(name: str) -> list:
    """The compile-only devices of the TPU slice `name`: libtpu describes its chips on the CPU, so
    XLA's TPU compiler compiles for a slice no one has booked. A missing libtpu and a name libtpu
    refuses are clear errors here, before anything compiles."""
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        raise ConfigError(
            f"--topology {name}: compiling for a TPU needs libtpu (XLA's TPU compiler), which is "
            "not installed; pip install -e '.[tpu]' (jax[tpu]: the libtpu of this jax)."
        )
    from jax.experimental import topologies

    # libtpu's lockfile keeps a second process off a TPU's chips; this one only compiles, so two
    # planners (or a planner beside a job on a TPU VM) may load libtpu together.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(name, platform="tpu").devices
    except jax.errors.JaxRuntimeError as error:
        reason = str(error).splitlines()[0]
        if not reason.startswith("INVALID_ARGUMENT"):
            raise
        raise ConfigError(
            f"--topology {name!r}: libtpu does not know this slice ({reason}); write "
            f"GENERATION:SHAPE, the chips along each axis of the slice, e.g. {TOPOLOGIES}."
        ) from None


def gpu_devices(need: int, flag: str = "--gpu") -> list:
    """This machine's first `need` GPUs, to compile for (`flag`); an error naming what it has
    when they are fewer."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) < need:
        raise ConfigError(
            f"{flag}: the mesh needs {need} GPUs and this machine has {len(gpus)}; plan a mesh "
            f"of at most {len(gpus)} devices with --mesh, or leave out {flag} for the CPU estimate."
            if gpus
            else f"{flag}: this machine has no GPU that jax can use (jax.devices('gpu') is empty); "
            f"run the planner on the GPU machine, or leave out {flag} for the CPU estimate."
        )
    return gpus[:need]


def gpu_topology_devices(name: str, description: str | None = None) -> list:
    """Compile-only devices of `name` ('HOSTSxGPUS'), through jax's CUDA plugin: of this
    machine's GPU kind (the local GPU gives the target description and autotunes the kernels),
    or of the GPU `description` (`gpu_target`) gives, on a machine with no GPU at all (and no
    autotuning). XLA's GPU compiler then partitions for the whole cluster."""
    match = re.fullmatch(r"(\d+)x(\d+)", name)
    if match is None or 0 in (hosts := int(match[1]), per_host := int(match[2])):
        raise ConfigError(
            f"--gpu-topology {name!r}: write HOSTSxGPUS, the hosts and the GPUs of each, e.g. 8x8."
        )
    from jax.experimental import topologies

    shape = f"1x{hosts}x{per_host}"
    if description is None:
        gpu_devices(1, "--gpu-topology")  # the GPU that stands in: a clear error without one
        return topologies.get_topology_desc(platform="cuda", topology=shape).devices
    try:
        return topologies.get_topology_desc(
            platform="cuda", topology=shape, target_config=description
        ).devices
    except (NotImplementedError, jax.errors.JaxRuntimeError) as error:
        raise ConfigError(
            "--gpu-target: jax's CUDA plugin could not describe GPUs from its description "
            f"({str(error).splitlines()[0]}); the file must be a GpuTargetConfigProto in text "
            "form whose fields this jaxlib knows."
        ) from None


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin (XLA's GPU compiler) is installed, GPU or not."""
    return any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def gpu_target(name: str) -> str:
    """The GPU description `name` gives (a name of GPU_TARGETS, or a file): a clear error where
    there is none, or where jax has no CUDA plugin to compile with."""
    path = GPU_TARGETS.get(name, pathlib.Path(name))
    if not path.is_file():
        raise ConfigError(
            f"--gpu-target {name}: no such GPU description; name one of "
            f"{', '.join(sorted(GPU_TARGETS))}, or give a GpuTargetConfigProto text file."
        )
    if not has_cuda_plugin():
        raise ConfigError(
            f"--gpu-target {name}: compiling for a GPU needs jax's CUDA plugin (XLA's GPU "
            "compiler), which is not installed; pip install -e '.[gpu]' (no GPU is needed)."
        )
    return path.read_text()


def mesh_devices(
    topology: str | None,
    mesh: config_lib.MeshConfig,
    gpu: str | bool = False,
    gpu_description: str | None = None,
) -> list:
    """The devices to plan on: this machine's GPUs with `gpu` True, the compile-only GPUs of a
    `--gpu-topology` given as `gpu` (of `gpu_description`, `gpu_target`'s, if given), the TPU
    slice's for a `--topology`, else one virtual CPU device per mesh position. Call it before jax
    starts its backend: it sets the CPU's device count."""
    need = math.prod(dataclasses.astuple(mesh))
    if gpu and topology is not None:
        raise ConfigError(f"a GPU target and --topology {topology}: compile for one; pick one.")
    if gpu:
        if gpu is True:
            return gpu_devices(need)
        if gpu_description is not None:
            mesh_lib.use_cpu_devices(1)  # this host only compiles
        return gpu_topology_devices(gpu, gpu_description)
    if topology is None:
        mesh_lib.use_cpu_devices(need)
        return jax.devices()[:need]
    mesh_lib.use_cpu_devices(1)  # the host only compiles: jax must not look for a TPU on it
    return topology_devices(topology)


def is_gpu(device) -> bool:
    return device.platform in ("gpu", "cuda", "rocm")


def chip_count(devices) -> int:
    """Distinct chips: libtpu describes a TPU v4 chip as two devices (its two cores, one coords);
    a v5p, v5e or v6e chip is one device, and so is each CPU device."""
    return len({tuple(d.coords) if d.platform == "tpu" else d.id for d in devices})


def hardware(devices: int, chips: int, kind: str) -> str:
    """`4 chips of TPU v5`, or for chips of several devices `4 chips of TPU v4, 2 devices each`."""
    split = f", {devices // chips} devices each" if devices != chips else ""
    return f"{chips} chip{'s' * (chips > 1)} of {kind}{split}"


def device_memory(
    devices, memory_gb: float | None, topology: str | None, gpu_description: str | None = None
) -> float:
    """GB per device to judge the peaks by: --memory, else what XLA may allocate of this machine's
    GPU (planned for, or standing in for a --gpu-topology) or of the GPU a --gpu-target describes
    (jax's share of its memory), an H200's for the CPU estimate, or the TPU chip's HBM shared by
    its devices. Known before compiling, so an unknown chip stops here."""
    if memory_gb is not None:
        return memory_gb
    if gpu_description is not None:
        total = int(re.search(r"device_memory_size: (\d+)", gpu_description)[1])
        share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEMORY_FRACTION))
        return total * share / GB
    if is_gpu(devices[0]):
        stats = jax.devices("gpu")[0].memory_stats()
        if not stats:
            raise ConfigError("this GPU does not report its memory to jax; pass --memory GB.")
        return stats["bytes_limit"] / GB
    if devices[0].platform != "tpu":
        return H200_GB
    kind = devices[0].device_kind
    if kind not in CHIP_GB:
        raise ConfigError(
            f"--topology {topology}: no memory figure for chips of {kind!r} (known: "
            f"{', '.join(CHIP_GB)}); pass --memory GB per device."
        )
    return CHIP_GB[kind] * chip_count(devices) / len(devices)


def check_fits(peak: int, what: str, fixes: str, limit: int | None = None) -> None:
    """Refuses `what`, a program whose peak is `peak` bytes a device (`plan.Figures.peak`), where
    it passes `limit` (None: what jax may allocate of this machine's GPU; nothing is checked off
    GPUs or where the allocator gives no limit), naming `fixes`: a run stops before its first
    step, not on an allocation in it. Arrays live beside the program are the caller's to free."""
    if limit is None:
        device = jax.devices()[0]
        limit = (device.memory_stats() or {}).get("bytes_limit") if is_gpu(device) else None
        if limit is None:
            return
    if peak > limit:
        raise ConfigError(
            f"{what} needs {peak / GB:.1f} GB a device, more than the {limit / GB:.1f} GB jax "
            f"may allocate: {fixes}."
        )


def count_mismatch(sizes: dict, devices) -> str:
    """Why the mesh does not fit the devices, and what to change."""
    need, have = math.prod(sizes.values()), len(devices)
    if devices and is_gpu(devices[0]):
        return (
            f"mesh {sizes} has {need} positions, the GPUs planned for are {have}; pass a --mesh "
            f"whose sizes multiply to {have}, or GPUs (--gpu-topology HOSTSxGPUS) that make {need}."
        )
    if devices and devices[0].platform == "tpu":
        slice_ = hardware(have, chip_count(devices), devices[0].device_kind)
        return (
            f"mesh {sizes} has {need} positions, the TPU slice has {have} devices ({slice_}); "
            f"pass a --mesh whose sizes multiply to {have}, e.g. --mesh data={have}, or a "
            f"--topology of {need} devices."
        )
    return (
        f"mesh {sizes} needs {need} devices, {have} were given; run `python -m jspec.jobs.plan` "
        "(it makes the virtual CPU devices), or set XLA_FLAGS="
        f"--xla_force_host_platform_device_count={need} before jax starts."
    )
