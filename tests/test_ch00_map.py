"""Chapter 00's claims, checked rather than claimed. The worked example — the chat template's string, its 37 prompt
ids and the ids the chapter names, the greedy reply's ids and text pieces — is computed here by the tokenizer (and,
in the slow test, by the model through chapter 03's generate loop, as the chapter's `generate` command runs it) and
must appear in the chapter word for word. The layering rules of section 5 are read from its picture (each row's
paths under nanoserve/) and checked on every `import` statement in nanoserve/ (a function's lazy import included);
modules loaded by name at run time (importlib, a `--student` seam) are checked by the module names the file spells
out in strings. The third
rule (the scheduler decides with integers) is also checked in a fresh interpreter, which sees what a library
imported by the scheduler's modules imports in turn.
tests/test_ch11_seam.py checks the seams below the engine core (distributed/ and text/ against the scheduler, the
block manager, kv/ and the model runner), here not repeated."""

import ast
import json
import os
import re
import subprocess
import sys
from functools import cache

import pytest

from nanoserve.cli import generate as generate_cli
from tests.chapter_text import ROOT, chapter, command_defaults, says

CH = "00"
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]


# --- the worked example ------------------------------------------------------------------------------------------

def quoted_reply_ids() -> list[int]:
    """The reply's ids as the chapter prints the `generate --json` line."""
    return json.loads(re.search(r'"token_ids": (\[[\d, ]+\])', chapter(CH))[1])


def test_the_chat_template_string(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(MESSAGES)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    says(CH, text)  # the ChatML block, line for line (whitespace normalised)


def test_the_prompt_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode_chat(MESSAGES)
    n, head, tail = len(ids), ", ".join(map(str, ids[:5])), ", ".join(map(str, ids[-4:]))
    says(CH, f"tokenizer string ─▶ list[int] ({n} ids)")
    says(CH, f"turns the string into {n} token ids: `[{head}, …, {tail}]`")
    says(CH, f"all {n} prompt tokens at once")
    says(CH, f"our {n} prompt tokens next to other requests'")
    says(CH, f'{{"prompt_token_ids": [{head}, ..., {tail}],')
    named = {"<|im_start|>": "is the single id", "system": "is", "\n": "the newline", " capital": "", " France": ""}
    phrases = []
    for text, verb in named.items():
        (token_id,) = tok.encode(text)  # one token each
        assert token_id in ids
        shown = "" if text == "\n" else f"`{text}` "
        phrases.append(f"{shown}{verb + ' ' if verb else ''}{token_id}")
    says(CH, ", ".join(phrases))


def test_the_reply_pieces(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = quoted_reply_ids()
    *words, eos = ids
    assert eos == tok.eos_token_id and tok.decode([eos]) == "<|im_end|>"
    pieces = [tok.decode([i]) for i in words]
    says(CH, f"first token is `{words[0]}` (`{pieces[0]}`)")
    says(CH, "the reply arrives as " + ", ".join(f"`{p}`" for p in pieces) + f" — then id {eos}, `<|im_end|>`, "
             "the end-of-sequence token: finish reason `stop`")
    says(CH, f'"text": {json.dumps(tok.decode(ids, skip_special_tokens=True))}, "finish_reason": "stop"')


@pytest.mark.slow
def test_the_greedy_reply_is_the_models(smollm2, smollm2_tokenizer):
    """What `generate --prompt ... --chat --temperature 0 --json` prints: its defaults, float32, the cache on."""
    from nanoserve.generate import generate

    args = command_defaults(generate_cli, "generate", "--prompt", QUESTION, "--chat", "--temperature", "0", "--json")
    assert args.weights == "fp32" and not args.no_cache
    tok = smollm2_tokenizer
    out = generate(smollm2, tok.encode_chat(MESSAGES), generate_cli.sampling_params(args), tok.eos_token_id, tok,
                   use_cache=True)
    assert out.token_ids == quoted_reply_ids()
    assert out.finish_reason == "stop"
    says(CH, f'"token_ids": {out.token_ids}, "text": {json.dumps(out.text)}')


# --- the layering rules ------------------------------------------------------------------------------------------

def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "nanoserve").rglob("*.py"))}


def parents(module: str) -> set[str]:
    """The packages Python runs before `module`: nanoserve, nanoserve.engine, ..."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


@cache
def import_statements(module: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(the module named, the names taken from it) for each nanoserve import in `module`'s file, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: a relative import"  # nanoserve imports absolutely
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return tuple((m, names) for m, names in found if m == "nanoserve" or m.startswith("nanoserve."))


@cache
def imports(module: str) -> frozenset[str]:
    """The nanoserve modules `module` imports: a submodule named in `from x import y` counts as y, and every
    package above an imported module counts too (Python runs it first)."""
    out = set()
    for target, names in import_statements(module):
        subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES}
        for m in subs | ({target} if len(subs) < len(names) or not names else set()):
            out |= {m} | parents(m)
    return frozenset(out - {module})


def closure(modules) -> set[str]:
    """Every nanoserve module importing `modules` runs (their packages included)."""
    seen, todo = set(), [m for module in modules for m in (module, *parents(module))]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += imports(m)
    return seen


@cache
def under(*prefixes: str) -> list[str]:
    """The modules of nanoserve/ under these names (a package and everything in it, or one module)."""
    full = tuple(f"nanoserve.{p}" for p in prefixes)
    return [m for m in MODULES if m in full or m.startswith(tuple(f + "." for f in full))]


def is_in(module: str, *prefixes: str) -> bool:
    return module in under(*prefixes)


# The picture of section 5: each row names its files by their path under nanoserve/ (a package `text/`, a module
# `engine/scheduler.py`, a top-level module `llm.py`); rows are separated by a line holding only "▼".
PATH = re.compile(r"(?<![\w./])((?:[a-z_]+/)*[a-z_]+(?:/|\.py))(?![\w.])")
SPLIT = ["nanoserve", "nanoserve.disagg", "nanoserve.engine"]  # packages whose modules stand in several rows
SIDE = ("text", "structured", "spec_decode", "distributed", "lora", "disagg.connector", "disagg.receive",
        "disagg.transport")  # the packages drawn beside the engine core and the worker (`···`)


@cache
def picture_rows() -> tuple[tuple[str, ...], ...]:
    """The paths each row of section 5's picture names, top row first (torch, which names none, left out)."""
    (path,) = (ROOT / "chapters").glob(f"{CH}-*.md")
    text = path.read_text()
    section = text[text.index("## 5. The layering rule"):text.index("## 6. The vocabulary")]
    picture = section.split("```")[1]
    rows = [tuple(PATH.findall(row)) for row in re.split(r"\n\s*▼\s*\n", picture)]
    return tuple(row for row in rows if row)


def dotted(path: str) -> str:
    """engine/scheduler.py -> engine.scheduler, text/ -> text (under() takes these)."""
    return path.removesuffix("/").removesuffix(".py").replace("/", ".")


@cache
def ranks() -> dict[str, int]:
    """module -> its row in the picture, counted from the bottom (0); a module stands in the row of the most
    specific path that covers it (`cluster/cli.py` before `cluster/`)."""
    rows = picture_rows()
    row_of = {path: len(rows) - 1 - i for i, row in enumerate(rows) for path in row}
    out = {}
    for m in MODULES:
        covering = [path for path in row_of if m in under(dotted(path))]
        if covering:
            out[m] = row_of[max(covering, key=len)]
    return out


def rank(module: str) -> int:
    return ranks().get(module, 0)  # SPLIT: their __init__ imports nothing (test_every_module_stands_in_one_row)


def test_the_check_sees_imports():
    """The checker itself: it finds a lazy import inside a method, a `from package import module`, and the
    imports the rules below forbid where they do exist (the server does reach the worker); and the picture's rows
    are distinct ranks, so a worker that imported the scheduler, or cluster/ that imported cli/'s commands, would
    point up."""
    assert "nanoserve.disagg.connector" in imports("nanoserve.engine.llm_engine")  # inside a method
    assert "nanoserve.lora.punica" in imports("nanoserve.lora.layers")  # from nanoserve.lora import punica
    assert "nanoserve.engine.worker" in imports("nanoserve.server.versions")
    assert rank("nanoserve.cli.serve") == rank("nanoserve.cluster.cli") > rank("nanoserve.cluster.router") \
        > rank("nanoserve.server.api_server") > rank("nanoserve.engine.async_engine") \
        > rank("nanoserve.engine.llm_engine") == rank("nanoserve.engine.scheduler") \
        > rank("nanoserve.engine.worker") == rank("nanoserve.engine.model_runner") == rank("nanoserve.engine.executor") \
        > rank("nanoserve.engine.scheduler_output") > rank("nanoserve.kv.block_manager") == 0
    assert rank("nanoserve.text.detokenizer") == rank("nanoserve.engine.llm_engine")  # the engine core's row
    assert {rank(m) for m in MODULES} == set(range(len(picture_rows())))


def test_every_module_stands_in_one_row():
    """Every package and module of nanoserve/ stands in the picture by its path; every path there exists."""
    paths = [path for row in picture_rows() for path in row]
    assert len(paths) == len(set(paths)), f"a path in two rows: {paths}"
    for path in paths:
        assert (ROOT / "nanoserve" / path).exists(), f"section 5's picture names nanoserve/{path}, which is not there"
    off = sorted(set(MODULES) - set(ranks()))
    assert off == SPLIT, f"modules on no row of section 5's picture: {sorted(set(off) - set(SPLIT))}"
    assert not any(import_statements(m) for m in SPLIT)  # Python runs them first: they import nothing of nanoserve
    says(CH, "Each row names its files by their path under `nanoserve/`")


def test_imports_only_point_down():
    says(CH, "The code is layered, and **imports only point down**")
    upward = [(m, t) for m in MODULES for t in imports(m) if rank(t) > rank(m)]
    assert not upward, f"imports that point up the picture: {upward}"


@cache
def loads_by_name(module: str) -> frozenset[str]:
    """The nanoserve modules `module`'s file spells out whole in a string (`student.module("nanoserve.engine.
    scheduler")`, `importlib.import_module("nanoserve.bench.peers")`): what it may load by name at run time."""
    tree = ast.parse(MODULES[module].read_text())
    return frozenset(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                     and isinstance(node.value, str) and node.value in MODULES and node.value != module)


# Loads by name allowed to point up: the top package's lazy `from nanoserve import LLM`, and student.py, whose
# tables name the reference module of every `--student` seam (its loader imports what the seam, in the seam's
# own row, asks for)
UP_BY_NAME = {"nanoserve": {"nanoserve.llm", "nanoserve.sampling"}, "nanoserve.student": set(MODULES)}


def test_loads_by_name_only_point_down():
    """A module named in a string is loaded by name (importlib, a `--student` seam): those point down too, so a
    load by name cannot smuggle in what an `import` statement may not."""
    upward = [(m, t) for m in MODULES for t in loads_by_name(m) - UP_BY_NAME.get(m, set()) if rank(t) > rank(m)]
    assert not upward, f"loads by name that point up the picture: {upward}"
    assert "nanoserve.engine.scheduler" in loads_by_name("nanoserve.engine.llm_engine")  # the checker sees them
    assert {(m, t) for m in UP_BY_NAME if m != "nanoserve.student" for t in loads_by_name(m)
            if rank(t) > rank(m)} == {("nanoserve", t) for t in UP_BY_NAME["nanoserve"]}  # the exception is used
    says(CH, "the top package, whose `LLM` and `SamplingParams` (`from nanoserve import LLM`) load `llm.py` and "
             "`sampling.py` lazily")


def test_the_model_knows_nothing_about_serving():
    says(CH, "`nanoserve/model/` imports nothing from `kv/` or `engine/`")
    reached = closure(under("model"))
    assert not [m for m in reached if is_in(m, "kv", "engine")]
    says(CH, "beside itself only `kernels/cpu_dot.py`, chapter 10's integer products, from its own row")
    beside = {"nanoserve.kernels", "nanoserve.kernels.cpu_dot"}
    assert reached <= set(under("model")) | {"nanoserve"} | beside, "model/ reaches outside itself"


def test_the_engine_never_tokenizes():
    says(CH, "the engine may hold a detokenizer, to produce text deltas and check stop strings, but it never tokenizes")
    reached = closure(under("engine"))
    assert not [m for m in reached if is_in(m, "text.tokenizer", "text.chat_template")]


THE_SCHEDULERS = ("nanoserve.engine.scheduler", "nanoserve.engine.policies", "nanoserve.engine.policies.fair",
                  "nanoserve.engine.policies.slo", "nanoserve.kv.block_manager", "nanoserve.kv.block_allocator",
                  "nanoserve.kv.prefix_cache")  # what decides a step: the scheduler, its policies, the block manager
ARRAYS = ("torch", "numpy")  # the libraries a tensor (or an array) would come from


def outside_imports(module: str) -> set[str]:
    """The top-level names of the non-nanoserve modules `module`'s file imports, anywhere in it (lazily too)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module.split(".")[0])
    return found - {"nanoserve"}


def test_the_scheduler_decides_with_integers():
    """The scheduler, its policies and the block manager import no tensor library and nothing of structured/ (the
    token masks), neither in their files (a lazy import included) nor through what they import: imported in a fresh
    interpreter, they leave torch, numpy and nanoserve.structured out of sys.modules."""
    says(CH, "**The scheduler decides with integers.** Token counts, block counts, a token budget — never tensors.")
    says(CH, "the scheduler never sees them")
    reached = closure(THE_SCHEDULERS)
    assert not [m for m in reached if is_in(m, "structured", "model", "kernels")], sorted(reached)
    assert not {m: found for m in reached if (found := outside_imports(m) & set(ARRAYS))}
    code = (f"import sys\nfor m in {THE_SCHEDULERS!r}: __import__(m)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in {ARRAYS!r}}}"
            f" | {{m for m in sys.modules if m == 'nanoserve.structured'}}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]"], f"importing the scheduler loads {run.stdout.strip()}"


def test_the_side_packages_import_only_the_engines_config():
    says(CH, "import at most one file of `engine/`: `engine/config.py`, the engine's settings, a leaf that imports "
             "nothing of nanoserve but one default of `spec_decode/policy.py` (`lora/` and the connector import it)")
    engine_imports = {m: {t for t in imports(m) if is_in(t, "engine") and t != "nanoserve.engine"}
                      for m in under(*SIDE)}
    multiproc = engine_imports.pop("nanoserve.distributed.multiproc")
    assert all(found <= {"nanoserve.engine.config"} for found in engine_imports.values()), engine_imports
    assert {m for m, found in engine_imports.items() if found} - set(under("lora")) == {"nanoserve.disagg.connector"}
    assert any(engine_imports[m] for m in under("lora"))
    assert closure(["nanoserve.engine.config"]) == {"nanoserve.engine.config", "nanoserve.engine", "nanoserve",
                                                    "nanoserve.spec_decode", "nanoserve.spec_decode.policy"}
    assert [names for m, names in import_statements("nanoserve.engine.config")] == [("DEFAULT_DISABLE_BY_BATCH_SIZE",)]
    says(CH, "`distributed/multiproc.py`, which starts the worker processes and so imports the worker and the model "
             "runner")
    assert multiproc == {"nanoserve.engine.worker", "nanoserve.engine.model_runner"}


def test_the_server_reads_the_core_only_in_its_stat_logger():
    """Below the async engine the server imports types, constants and release_memory; only server/metrics.py reads
    the engine's scheduler and block manager (the stat logger the async engine calls after every step)."""
    taken = {}
    for m in under("server"):
        for target, names in import_statements(m):
            if is_in(target, "engine") and not is_in(target, "engine.async_engine"):
                taken.setdefault(target, set()).update(names)
    assert taken == {"nanoserve.engine.llm_engine": {"RequestOutput"}, "nanoserve.engine.policies": {"SLOTargets"},
                     "nanoserve.engine.sleep_mode": {"SLEEP_LEVELS"}, "nanoserve.engine.worker": {"release_memory"},
                     "nanoserve.engine.snapshot": {"encode_pool"}}
    says(CH, "only types and constants (`RequestOutput`, `SLOTargets`, `SLEEP_LEVELS`) and two functions: the "
             "worker's `release_memory`")
    says(CH, "the snapshot format's `encode_pool`")
    readers = {m for m in under("server") for node in ast.walk(ast.parse(MODULES[m].read_text()))
               if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "block_manager")}
    assert readers == {"nanoserve.server.metrics"}
    says(CH, "its Prometheus stat logger (`server/metrics.py`), which the async engine calls in the engine thread "
             "after every step, reads the core's state directly")
