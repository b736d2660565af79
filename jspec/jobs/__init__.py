"""Entry points: each module is a job with `main(argv)`, run as `python -m jspec.jobs.<job>`
(or its console script, `pyproject.toml`), and under `jspec.jobs.distributed` on many hosts."""
