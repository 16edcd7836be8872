"""Benchmarks behind `python -m nanoserve bench NAME`: see nanoserve/cli/bench.py."""
