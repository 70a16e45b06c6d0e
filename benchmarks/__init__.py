"""Benchmarks: run ``python benchmarks/run.py``."""
