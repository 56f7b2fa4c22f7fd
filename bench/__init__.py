"""Benchmarks of nonomad's components: `python -m bench` (or `make bench`) runs them.

Each benchmark starts real processes on 127.0.0.1 only, bounds every load loop in count and
time, prints a table (metric, value, target, ok?) and writes JSON to `bench/results/`.
"""
