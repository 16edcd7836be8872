"""Chapter 11's seam, checked rather than claimed: tensor parallelism lives below the engine core. The scheduler,
the block manager and kv/ import nothing of nanoserve/distributed/ (in the engine only the model runner, the worker,
the executor and, once, LLMEngine meet it); and what the engine core (LLMEngine.step()) drives — scheduler, block
manager, model runner, kv/ — imports nothing of nanoserve/text/ (text <-> ids: only LLMEngine's output step
detokenizes and checks stop strings) or nanoserve/server/ (chapter 00's layering). The server's own files name nothing
of distributed/ either; the engine they talk to does (its executor), so their import closure holds it.

Two independent checks: every `import` statement the modules hold, followed through nanoserve's own modules
(functions' imports included, so a lazy import inside a method counts), and what importing them really loads
(sys.modules in a fresh interpreter)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KV = sorted(f"nanoserve.kv.{p.stem}" for p in (ROOT / "nanoserve" / "kv").glob("*.py") if p.stem != "__init__")
NO_DISTRIBUTED = ["nanoserve.engine.scheduler", "nanoserve.engine.sequence", *KV]  # every module of kv/
NO_TEXT = NO_DISTRIBUTED + ["nanoserve.engine.model_runner"]  # below LLMEngine's output step
SERVER = sorted(f"nanoserve.server.{p.stem}" for p in (ROOT / "nanoserve" / "server").glob("*.py") if p.stem != "__init__")
TEXT_AND_SERVER = ("nanoserve.text", "nanoserve.server")


def source_of(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None  # a name inside a module (`from nanoserve.x import name`), not a module


def imported_by(module: str) -> set[str]:
    """The nanoserve modules one module's import statements name, wherever in the file they stand."""
    names = set()
    for node in ast.walk(ast.parse(source_of(module).read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("nanoserve.") and source_of(name)}


def static_closure(modules) -> set[str]:
    seen, todo = set(), list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imported_by(module)
    return seen


@pytest.fixture(scope="module")
def loaded():
    """{module: the nanoserve modules importing it loads}, in one fresh interpreter that forgets nanoserve's
    modules between imports."""
    code = ("import importlib, json, sys\nout = {}\nfor m in sys.argv[1:]:\n"
            "    before = set(sys.modules)\n    importlib.import_module(m)\n"
            "    out[m] = sorted(k for k in sys.modules if k.startswith('nanoserve'))\n"
            "    for k in [k for k in set(sys.modules) - before if k.startswith('nanoserve')]: del sys.modules[k]\n"
            "print(json.dumps(out))")  # torch and the rest stay loaded: only nanoserve's modules are forgotten
    out = subprocess.run([sys.executable, "-c", code, *NO_TEXT], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return json.loads(out.stdout)


def test_the_check_sees_imports():
    """The checker itself: the model runner does import distributed/ (the seam), the server does import text/, and
    reaches distributed/ through the engine."""
    assert "nanoserve.distributed.parallel_state" in static_closure(["nanoserve.engine.model_runner"])
    assert any(m.startswith("nanoserve.text") for m in static_closure(["nanoserve.server.api_server"]))
    # the server reaches distributed/ only through the engine it talks to
    assert "nanoserve.server.api_server" in SERVER and len(SERVER) > 10
    assert {"nanoserve.kv.block_manager", "nanoserve.kv.tiered_block_manager"} <= set(KV) and len(KV) > 10
    assert "nanoserve.distributed.parallel_state" in static_closure(["nanoserve.server.api_server"])
    assert "nanoserve.distributed.parallel_state" in static_closure(["nanoserve.engine.async_engine"])


@pytest.mark.parametrize("module", SERVER)
def test_the_servers_own_files_import_nothing_of_distributed(module):
    """Chapter 08's server names no part of tensor parallelism: none of its files' import statements does (what
    they import in turn, the engine, does)."""
    assert not [m for m in imported_by(module) if m.startswith("nanoserve.distributed")]


@pytest.mark.parametrize("module", NO_DISTRIBUTED)
def test_scheduler_block_manager_and_kv_know_nothing_of_distributed(module, loaded):
    assert not [m for m in static_closure([module]) if m.startswith("nanoserve.distributed")]
    assert not [m for m in loaded[module] if m.startswith("nanoserve.distributed")]


@pytest.mark.parametrize("module", NO_TEXT)
def test_scheduler_block_manager_and_model_runner_know_nothing_of_text_or_server(module, loaded):
    assert not [m for m in static_closure([module]) if m.startswith(TEXT_AND_SERVER)]
    assert not [m for m in loaded[module] if m.startswith(TEXT_AND_SERVER)]
