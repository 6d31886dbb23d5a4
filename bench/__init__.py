"""Benchmarks: `make bench` (or `python -m bench`) runs them all; see BENCHMARKS.md."""
