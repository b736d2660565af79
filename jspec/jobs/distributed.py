"""Runs any jspec job on many hosts: initialises `jax.distributed`, then the job's `main`.

    jspec-launch train_rl --config demo                     # under srun, or in a Kubernetes pod
    jspec-launch --coordinator host0:8476 --num-processes 2 --process-id 0 train_rl --config demo

JAX's multi-controller runtime runs one process per host (or per GPU); every process runs the same
program over all devices of one mesh. Where the processes meet comes from, in this order:
- flags `--coordinator HOST:PORT --num-processes N --process-id I` (or the environment variables
  JSPEC_COORDINATOR, JSPEC_NUM_PROCESSES, JSPEC_PROCESS_ID);
- Kubernetes, an indexed Job or a JobSet (`launch/jobset.yaml`): the pod's JOB_COMPLETION_INDEX is
  the process id, JSPEC_NUM_PROCESSES the count, and the coordinator the pod of index 0 (JobSet's
  DNS name `<jobset>-<job>-0-0.<jobset>`, or JSPEC_COORDINATOR);
- SLURM (`launch/slurm.sbatch`, one task per host under `srun`): JAX reads SLURM_* itself.
Nothing of these: one process, as on a laptop. The job is a module of `jspec.jobs` (`train_rl`,
`demo`, ...) or any dotted module with a `main(argv)` (`jspec.bench.rollout`). What a job does on
many hosts is its own: `train_rl` loads each host's rows only (`jspec.hosts`), writes metrics and
logs from process 0, and saves orbax checkpoints from all processes into one shared directory.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping

from jspec.config import ConfigError
from jspec.jobs import cli

PORT = 8476


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("job", help="a module of jspec.jobs (train_rl, demo, ...) or a dotted module")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the job's own arguments")
    return p.parse_args(argv)


def cluster(args, env: Mapping[str, str]) -> dict | None:
    """`jax.distributed.initialize` keyword arguments for this process; {} lets JAX detect SLURM;
    None is a single process."""
    coordinator = args.coordinator or env.get("JSPEC_COORDINATOR")
    count = args.num_processes or _int(env, "JSPEC_NUM_PROCESSES")
    index = args.process_id if args.process_id is not None else _int(env, "JSPEC_PROCESS_ID")
    if index is None and "JOB_COMPLETION_INDEX" in env:  # Kubernetes indexed Job / JobSet
        index = _int(env, "JOB_COMPLETION_INDEX")
        if coordinator is None and "JOBSET_NAME" in env:
            name, job = env["JOBSET_NAME"], env.get("REPLICATED_JOB_NAME", "workers")
            coordinator = f"{name}-{job}-0-0.{name}:{PORT}"
    if coordinator or count or index is not None:
        given = {"coordinator": coordinator, "num-processes": count, "process-id": index}
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ConfigError(
                f"a multi-process launch needs --coordinator, --num-processes and --process-id "
                f"(or JSPEC_COORDINATOR, JSPEC_NUM_PROCESSES, JSPEC_PROCESS_ID); missing: "
                f"{', '.join(missing)}."
            )
        if not 0 <= index < count:
            raise ConfigError(f"--process-id={index} must be in [0, --num-processes={count}).")
        return dict(coordinator_address=coordinator, num_processes=count, process_id=index)
    if _int(env, "SLURM_NTASKS", 1) > 1 and "SLURM_STEP_NODELIST" in env:
        return {}
    return None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    if name not in env:
        return default
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} must be an integer.") from None


def job_main(name: str):
    """The `main(argv)` of job `name`."""
    module = name if "." in name else f"jspec.jobs.{name}"
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise ConfigError(
            f"job {name!r}: no module {module}; use a module of jspec.jobs (train_rl, demo, "
            "...) or a dotted module path with a main(argv), e.g. jspec.bench.rollout."
        ) from None


def main(argv=None):
    args = parse_args(argv)
    run = job_main(args.job)
    kwargs = cluster(args, os.environ)
    if kwargs is not None:
        import jax

        # CPU devices join collectives across processes only through gloo (GPUs use NCCL).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**kwargs)
    return run(args.args)


if __name__ == "__main__":
    sys.exit(cli.run(main))
