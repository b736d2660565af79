"""Measurements: benchmarks and GPU checks (`python -m jspec.bench.<name>`). They import the
product; nothing of the product imports them."""
