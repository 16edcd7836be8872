"""Swap the learner's exercise code in for the reference code.

Every exercise file under `exercises/` mirrors one reference module (same names, same
signatures). Tests ask `implementation("nanoserve.model.attention")` for the module they
grade: the reference, or — with NANOSERVE_IMPL=student, as `make grade` sets it — the
learner's file. The engine uses the same switch to run a finished exercise for real.
"""

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

EXERCISES = Path(__file__).resolve().parent.parent / "exercises"

# reference module -> the learner's file that mirrors it
STUDENT_FILES = {
    "nanoserve.model.attention": "01-attention/attention.py",
    "nanoserve.model.layers": "02-the-model/layers.py",
    "nanoserve.model.block": "02-the-model/block.py",
    "nanoserve.kv.naive": "04-kv-cache/naive.py",
    "nanoserve.memory": "04-kv-cache/memory.py",
    "nanoserve.kv.block_allocator": "05-paged-kv/block_allocator.py",
    "nanoserve.kv.prefix_cache": "05-paged-kv/prefix_cache.py",
    "nanoserve.engine.scheduler": "06-continuous-batching/scheduler.py",
    "nanoserve.sampling": "03-tokens-and-sampling/sampling.py",
    "nanoserve.detokenizer": "03-tokens-and-sampling/detokenizer.py",
    "nanoserve.server.streaming": "08-http-serving/streaming.py",
    "nanoserve.engine.snapshot": "12-engine-view/snapshot.py",
}


def use_student() -> bool:
    return os.environ.get("NANOSERVE_IMPL", "reference") == "student"


def load_student(module: str) -> ModuleType:
    """Import the learner's mirror of `module` from exercises/."""
    if module not in STUDENT_FILES:
        raise KeyError(f"no exercise mirrors {module}; known: {sorted(STUDENT_FILES)}")
    path = EXERCISES / STUDENT_FILES[module]
    spec = importlib.util.spec_from_file_location("student_" + module.replace(".", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def implementation(module: str) -> ModuleType:
    """The module to grade: the learner's when NANOSERVE_IMPL=student, else the reference."""
    return load_student(module) if use_student() else importlib.import_module(module)
