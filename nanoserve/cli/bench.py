"""`python -m nanoserve bench NAME ...`: the course's measurements, one module per benchmark
in `nanoserve/bench/`. Each prints its numbers and the command that reproduces them.

Speed is measured here, never asserted in tests: this machine is noisy, so every benchmark
reports ratios measured side by side in one run.
"""

import importlib

BENCHMARKS = ["model", "kv_cache", "paged_kv", "linear", "offline", "attention", "http", "serve", "profile",
              "experiment", "weights", "quality", "tp",
              "engine_view", "degrade", "soak", "peers", "spec", "structured", "bluegreen", "mlperf", "lora"]


def register(sub, only: list[str] | None = None):
    """only: the benchmarks to register (each module imports torch); None: all of them."""
    p = sub.add_parser("bench", help="run a benchmark (speed and memory measurements)")
    benches = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHMARKS if only is None else only:
        importlib.import_module(f"nanoserve.bench.{name}").register(benches)
