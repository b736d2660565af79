"""Entry points: each module is a job with `main(argv)`, run as `python -m jspec.launch.<job>`
(or its console script, `pyproject.toml`), and under `jspec.launch.distributed` on many hosts."""
