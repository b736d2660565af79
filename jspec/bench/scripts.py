"""The console scripts of the measurements (pyproject.toml's [project.scripts]): each runs its
module's `main` under `jspec.jobs.cli.run`, as the jobs' scripts do."""

from jspec.jobs.cli import entry

bench_attention = entry("jspec.bench.attention")
bench_moe = entry("jspec.bench.moe")
bench_rollout = entry("jspec.bench.rollout")
bench_pipeline = entry("jspec.bench.pipeline")
bench_async_rl = entry("jspec.bench.async_rl")
bench_decode_kernel = entry("jspec.bench.decode_kernel")
check_gpu_attention = entry("jspec.bench.check_gpu_attention")
