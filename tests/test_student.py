"""`--student` / `LLM(student=...)`: the learner's finished exercises serve, the unfinished ones fall back
to the reference with a warning naming the exercise, and the run says whose code ran and how often.

The "finished" learner code is the reference itself, copied into a temporary exercises folder (the
repository's own stubs stay untouched); its answers must then equal a reference run's token for token.
"""

import ast
import importlib
import inspect
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from nanoserve import student
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.student import RUNGS, STUDENT_FILES, StudentCode, parse_selection, unfinished
from tests.tiny_model import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture
def exercises(tmp_path, monkeypatch):
    """A copy of exercises/ that the loader reads; `solve(module)` puts the reference in the learner's file."""
    root = tmp_path / "exercises"
    shutil.copytree(student.EXERCISES, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(student, "EXERCISES", root)

    def solve(module: str) -> Path:
        path = root / STUDENT_FILES[module]
        shutil.copy(importlib.import_module(module).__file__, path)
        return path

    return solve


def finish(module: str, qualnames: list[str]) -> Path:
    """The learner finished some rungs of a ladder: in the (copied) stub of `module`, the stubs of `qualnames`
    ("slot_mapping", "BlockManager.allocate_slots") become the reference's code; the other stubs stay."""
    path = student.EXERCISES / STUDENT_FILES[module]
    lines = path.read_text().splitlines(keepends=True)
    defs = {}
    for node in ast.parse("".join(lines)).body:
        for item in [node] + (node.body if isinstance(node, ast.ClassDef) else []):
            if isinstance(item, ast.FunctionDef):
                defs[item.name if item is node else f"{node.name}.{item.name}"] = item
    reference = importlib.import_module(module)
    for qualname in sorted(qualnames, key=lambda q: -defs[q].lineno):  # bottom up: line numbers above stay valid
        node, code = defs[qualname], reference
        for part in qualname.split("."):
            code = inspect.getattr_static(code, part)
        start = (node.decorator_list[0] if node.decorator_list else node).lineno - 1
        code = getattr(code, "fn", code)  # a @triton.jit function (chapter 07) holds the Python function
        lines[start:node.end_lineno] = [inspect.getsource(getattr(code, "__func__", code))]
    path.write_text("".join(lines))
    return path


# A shared 8-token prefix (two blocks of 4) makes the prefix cache hit; 5 requests on 11 blocks preempt one.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9 + i, 20 + i, 30 + i] for i in range(5)]


def serve(model, code: StudentCode | None = None, **config) -> tuple[LLMEngine, dict[str, list[int]]]:
    """The 5 PROMPTS through an engine on `model` (`code`: the StudentCode that built it, reported by the engine)."""
    engine = LLMEngine(model, engine_config(num_blocks=11, block_size=4, max_num_batched_tokens=16, **config),
                       student=code)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
    return engine, tokens


def test_selection_forms():
    assert parse_selection(True) == set(student.chapters()) and parse_selection(False) == set()
    assert parse_selection("5,06") == {"05", "06"} == parse_selection(["05", "06"])
    with pytest.raises(ValueError, match="chapter.*20.*chapters with exercises: 01"):
        parse_selection("05,20")


@pytest.mark.parametrize("module", sorted(STUDENT_FILES))
def test_every_pristine_stub_marks_itself_unfinished(module):
    chapter = str(int(STUDENT_FILES[module][:2]))
    todo = unfinished(student.EXERCISES / STUDENT_FILES[module])
    assert todo, f"{STUDENT_FILES[module]} has no `raise NotImplementedError(\"Exercise {chapter}.N: ...\")` left"
    assert all(exercise.startswith(f"Exercise {chapter}.") for exercise in todo), todo
    assert unfinished(Path(importlib.import_module(module).__file__)) == {}


def test_finished_05_serves_and_untouched_06_falls_back(tiny, exercises, capsys):
    exercises("nanoserve.kv.block_allocator")
    exercises("nanoserve.kv.prefix_cache")
    _, expected = serve(tiny)
    with pytest.warns(UserWarning, match=r"Exercise 6\.1, .*6\.4 not finished in exercises/06-continuous-batching"):
        engine, tokens = serve(tiny, student=True)
    assert tokens == expected
    assert type(engine.block_manager.allocator).__module__ == "student_nanoserve_kv_block_allocator"
    assert type(engine.block_manager.prefix_cache).__module__ == "student_nanoserve_kv_prefix_cache"
    assert type(engine.scheduler).__module__ == "nanoserve.engine.scheduler"
    calls = engine.student.calls
    # 5 prompts of 11 tokens + 6 outputs: at least one allocation and one free per request
    assert calls["BlockAllocator.allocate"] >= 5 and calls["BlockAllocator.free"] >= 5
    assert calls["PrefixCache.get"] > 0 and engine.block_manager.stats.hit_blocks > 0
    err = capsys.readouterr().err
    assert "yours      BlockAllocator  from exercises/05-paged-kv/block_allocator.py" in err
    assert "reference  nanoserve.engine.scheduler" in err and "Exercise 6.1 (Scheduler.schedule_waiting)" in err
    proof = engine.student_proof()
    assert f"BlockAllocator.allocate ×{calls['BlockAllocator.allocate']}" in proof
    assert f"prefix-cache hits: {engine.block_manager.stats.hit_blocks} blocks" in proof


def test_finished_01_and_02_build_the_model_that_attends_without_a_cache(tiny, exercises):
    """`generate --no-cache --student 01,02`: the model is built from the learner's Llama, blocks and RMSNorm (02),
    and without a cache it attends with the learner's attention (01). Same weights, so the reference's logits."""
    for module in ("nanoserve.model.attention", "nanoserve.model.layers", "nanoserve.model.block",
                   "nanoserve.model.llama"):
        exercises(module)
    code = StudentCode("01,02")
    model = code.module("nanoserve.model.llama").Llama(tiny.config, code.module).eval()
    model.load_state_dict(tiny.state_dict())
    assert type(model).__module__ == "student_nanoserve_model_llama"
    assert type(model.layers[0]).__module__ == "student_nanoserve_model_block"
    assert type(model.layers[0].input_layernorm).__module__ == "student_nanoserve_model_layers"  # linked into block.py
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():  # no cache: the model's own attention is the learner's (chapter 01)
        torch.testing.assert_close(model.compute_logits(model(ids)), tiny.compute_logits(tiny(ids)))
    calls = code.calls
    assert calls["scaled_dot_product_attention"] == tiny.config.num_hidden_layers == calls["DecoderBlock.forward"]
    assert calls["Llama.forward"] == 1 and calls["RMSNorm.forward"] == 2 * tiny.config.num_hidden_layers + 1
    report = code.describe(runs="the generate loop ran")
    for file in ("02-the-model/llama.py", "02-the-model/block.py", "02-the-model/layers.py", "01-attention/attention.py"):
        assert f"from exercises/{file}" in report


REFUSED_01 = "the engine attends with chapter 05's paged attention and never calls chapter 01's code; " \
             "generate --student 01 runs it"
REFUSED_04 = "the engine keeps its K/V in chapter 05's paged blocks and never calls chapter 04's code; " \
             "generate --student 04 runs your cache, memory --student 04 your formula"
REFUSED_09 = "the engine never calls chapter 09's code (the metrics and open-loop load of a benchmark of a server); " \
             "bench serve --student 09 runs it"


@pytest.mark.parametrize("selection, reason", [
    ("01", REFUSED_01), ("1,05", REFUSED_01), (["01", "02"], REFUSED_01),
    ("04", REFUSED_04), ("03,4", REFUSED_04), (["04", "05"], REFUSED_04),
    ("01,04", f"{REFUSED_01}; {REFUSED_04}"), ("09", REFUSED_09), ("04,09", f"{REFUSED_04}; {REFUSED_09}"),
], ids=["01", "1,05", "01+02", "04", "03,4", "04+05", "01,04", "09", "04,09"])
def test_the_engine_refuses_a_selection_that_names_01_04_or_09(tiny, monkeypatch, selection, reason):
    """The engine attends with chapter 05's paged attention over chapter 05's paged blocks, so neither chapter 01's
    attention nor chapter 04's cache and formula run in a step, and chapter 09's metrics and load run in a benchmark
    of a server: a selection that names 01, 04 or 09 is refused by the engine (LLMEngine before it builds anything,
    LLM before its model loads), naming the commands that run them."""
    with pytest.raises(ValueError) as refused:
        LLMEngine(tiny, engine_config(num_blocks=11, student=selection))
    assert str(refused.value) == f"student={selection!r}: {reason}"
    import nanoserve.model
    from nanoserve.llm import LLM

    monkeypatch.setattr(nanoserve.model, "load_gguf", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(ValueError) as refused:
        LLM(student=selection)
    assert str(refused.value).endswith(reason)


# which commands call each chapter's code outside the step, read from the callers: serve's server (08: runner.py's
# async engine and api_server.py's request handling; 12: async_engine.py's event feed), a request's grammar (13:
# SamplingParams.structured, from serve's response_format), a fleet's router (16: cluster/router.py), a decode engine
# (17: --kv-role decode) and adapters (19: --lora-modules) are serve's alone; bench http's server runs the engine's
# event feed (12) on every step but the reference's request handling (its ServerConfig selects no chapter)
CALLED_BY = {"serve": {"08", "12", "13", "16", "17", "19"}, "batch": set(), "bench offline": set(),
             "bench mlperf": set(), "bench http": {"12"}}


@pytest.mark.parametrize("command", sorted(CALLED_BY))
@pytest.mark.parametrize("chapter", ["08", "12", "13", "16", "17", "19"])
def test_a_command_refuses_a_chapter_it_never_calls_and_names_the_command_that_does(command, chapter):
    """The engine takes chapters 08, 12, 13, 16, 17 and 19 (serve builds its engines through LLM, and its server,
    a request's grammar, its fleet's router or its decode engine calls their code), but a command that never calls
    one refuses it, with the command that runs it; a bare --student, every chapter, is taken."""
    refused = student.engine_refusal(f"05,{chapter}", command)
    assert student.engine_refusal(chapter) is None and student.engine_refusal(True, command) is None
    if chapter in CALLED_BY[command]:
        assert refused is None
    else:
        assert refused.startswith(f"{command} never calls chapter {chapter}'s code (") and "serve " in refused


@pytest.mark.parametrize("argv, refused", [
    (["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--student", "16"], "batch never calls chapter 16"),
    (["bench", "http", "--student", "12,13"], "bench http never calls chapter 13"),
    (["serve", "--student", "08,12,13,16,17,19"], None),
    (["serve", "--student", "09"], "the engine never calls chapter 09"),
    (["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--student"], None),
])
def test_the_cli_refuses_per_command(argv, refused, tmp_path, monkeypatch):
    """check_engine_args reads the command from the parsed line (batch, serve, bench NAME) and asks engine_refusal
    for that command's own list: serve takes what batch refuses."""
    from nanoserve.cli import Parser, bench, serve
    from nanoserve.cli import batch as batch_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    parser = Parser()
    sub = parser.add_subparsers(dest="command")
    batch_cli.register(sub)
    serve.register(sub)
    bench.register(sub, only=["http"])
    problem = batch_cli.check_engine_args(parser.parse_args(argv))
    assert problem is None if refused is None else refused in problem, problem


def test_the_engine_takes_16_and_17_and_says_where_they_plug_in(tiny):
    """LLM and LLMEngine take chapter 16 and 17 (a fleet's replicas and a decode engine are built through them) and,
    where this run never calls them, say which flag does."""
    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, student="12,16,17"))
    assert engine.student.describe().splitlines()[1:] == [
        "  (chapter 12's code runs only behind the HTTP server's engine page: serve --student 12)",
        "  (chapter 16's code runs only in a fleet's router: add --replicas N)",
        "  (chapter 17's code runs only in a decode engine: add --kv-role decode, or --disaggregated "
        "(kv_transfer_config from Python))"]


def test_a_bare_student_is_taken_and_reports_01_as_never_called(tiny, exercises):
    """A bare --student (True: every chapter) serves; the model asks for chapter 01's module, the engine never
    calls it, and the report says so. Chapter 04's files the engine never even loads."""
    exercises("nanoserve.model.attention")
    code = StudentCode(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the other chapters' stubs fall back, each with its warning
        model = code.module("nanoserve.model.llama").Llama(tiny.config, code.module).eval()
        model.load_state_dict(tiny.state_dict())
        serve(model, code, student=True)
    assert "scaled_dot_product_attention" in code.never_called()
    assert not set(code.calls) & {name for names in RUNGS["nanoserve.model.attention"].values() for name in names}
    assert "scaled_dot_product_attention" in code.proof().splitlines()[-1]  # "yours, never called in this run: ..."
    assert not {"nanoserve.kv.naive", "nanoserve.memory"} & set(code.used)  # chapter 04's files: not even loaded
    (idle,) = [line for line in code.describe().splitlines() if line.startswith("  (no exercise of chapter ")]
    assert "04" in idle.removeprefix("  (no exercise of chapter ").split(" plugs")[0].split(", ")


def test_a_finished_02_rmsnorm_runs_every_norm_of_the_model(tiny, exercises):
    """Only 2.1 done (block.py and llama.py still stubs): `--student 02` builds every RMSNorm of the model from the
    learner's class — two per block, built by block.py's given constructor, and the final one — not the final
    norm alone; the report names it with its calls, 2 · layers + 1 per forward pass."""
    from nanoserve.model import LlamaConfig

    finish("nanoserve.model.layers", ["RMSNorm.forward"])
    code = StudentCode("02")
    with pytest.warns(UserWarning, match=r"Exercise 2\.2 not finished in exercises/02-the-model/block\.py: the "
                                         r"reference's DecoderBlock\.forward runs instead, in your file"):
        model = code.module("nanoserve.model.llama").Llama(tiny.config, code.module).eval()
    model.load_state_dict(tiny.state_dict())
    learners = code.module("nanoserve.model.layers").RMSNorm
    assert learners.__module__ == "student_nanoserve_model_layers"
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 2 * tiny.config.num_hidden_layers + 1 and all(type(m) is learners for m in norms)
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(model(ids)), tiny.compute_logits(tiny(ids)))
        model(ids)
    per_pass = 2 * tiny.config.num_hidden_layers + 1
    assert {name: n for name, n in code.calls.items() if not name.split(".")[-1].startswith("_")} == \
        {"RMSNorm.forward": 2 * per_pass}
    lines = code.describe().splitlines()
    assert "  yours      RMSNorm.forward  from exercises/02-the-model/layers.py" in lines
    assert "  reference  DecoderBlock.forward  (Exercise 2.2 not finished)" in lines
    assert code.proof() == f"--student: your code served: RMSNorm.forward ×{2 * per_pass}"
    # SmolLM2's shape (built on the meta device: no weights): 61 norms, every one the learner's
    with torch.device("meta"):
        smollm2 = code.module("nanoserve.model.llama").Llama(LlamaConfig(), code.module)
    norms = [m for m in smollm2.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 61 and all(type(m) is learners for m in norms)


# Each rung of chapter 02 alone (the other files still stubs), and all three: what the learner wrote runs in the
# engine's steps, whose forward passes are the paged cache's (`--student 02` without chapter 01).
RUNGS_02 = {"2.1": {"nanoserve.model.layers": ["RMSNorm.forward"]},
            "2.2": {"nanoserve.model.block": ["DecoderBlock.forward"]},
            "2.3": {"nanoserve.model.llama": ["Llama.forward", "Llama.compute_logits"]}}
RUNGS_02["all"] = {module: names for rung in RUNGS_02.values() for module, names in rung.items()}


@pytest.mark.parametrize("rung", sorted(RUNGS_02))
def test_a_finished_02_rung_serves_in_the_engine(tiny, exercises, rung):
    """`batch --student 02` with one rung done (or all three): the engine serves the model built from the learner's
    file, the learner's functions are the ones called in its steps, and the tokens are the reference's."""
    _, expected = serve(tiny)
    for module, qualnames in RUNGS_02[rung].items():
        finish(module, qualnames)
    code = StudentCode("02")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = code.module("nanoserve.model.llama").Llama(tiny.config, code.module).eval()
    model.load_state_dict(tiny.state_dict())
    todo = {f"Exercise {r}" for r in ("2.1", "2.2", "2.3") if rung not in (r, "all")}
    assert {m for m in todo if any(m in str(w.message) for w in caught)} == todo  # the stubs fall back, with a warning
    engine, tokens = serve(model, code, student="02")
    assert tokens == expected
    calls = {name: n for name, n in code.calls.items() if not name.split(".")[-1].startswith("_")}
    assert set(calls) == {name for names in RUNGS_02[rung].values() for name in names}
    layers, steps = tiny.config.num_hidden_layers, calls.get("Llama.forward")
    if "DecoderBlock.forward" in calls:  # every block of every pass is the learner's
        assert calls["DecoderBlock.forward"] % layers == 0 and calls["DecoderBlock.forward"] >= layers * len(PROMPTS)
        assert steps is None or calls["DecoderBlock.forward"] == layers * steps
    if "RMSNorm.forward" in calls:  # and every norm: 2 per block, the final one
        assert calls["RMSNorm.forward"] % (2 * layers + 1) == 0 and calls["RMSNorm.forward"] >= len(PROMPTS)
    if steps is not None:
        assert steps >= len(PROMPTS) and calls["Llama.compute_logits"] >= len(PROMPTS)
    assert engine.student_proof().startswith("--student: your code served: ")


def test_02_refuses_a_compiled_step(tiny, exercises):
    """A compiled step runs its own loop over the reference block's halves (chapter 09), never the learner's
    Llama.forward or DecoderBlock.forward: the engine refuses the pair rather than serve without them."""
    with pytest.raises(ValueError, match="compile_mode dynamic .* not with chapter 02's exercises"):
        serve(tiny, compile_mode="dynamic", student="02")


OFFSET = "offset = num_keys - num_queries"  # the line of chapter 01's causal_mask that the classic bug drops


def generate_with(model, student) -> tuple[list[int], StudentCode]:
    """`generate --student NN` on `model`: chapter 03's loop with chapter 04's cache, greedy, 10 tokens."""
    from nanoserve.generate import generate

    code = StudentCode(student)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return generate(model, PROMPTS[0], params, 0, use_cache=True, modules=code.module).token_ids, code


def test_finished_01_attends_inside_chapter_04s_cache_where_the_offset_counts(tiny, exercises):
    """`generate --student 01`: chapter 04's cache calls the learner's attention on the prompt (T = S), then on one
    query against every cached key (T = 1 < S), so the mask's offset serves; the classic bug (offset = 0) leaves the
    first token right (the prompt is T = S) and changes the rest."""
    expected, _ = generate_with(tiny, student=False)
    path = exercises("nanoserve.model.attention")
    tokens, code = generate_with(tiny, student="01")
    assert tokens == expected
    passes = len(expected) * tiny.config.num_hidden_layers  # the prompt, then a token at a time: 10 passes per layer
    assert dict(code.calls) == {"scaled_dot_product_attention": passes, "causal_mask": passes, "repeat_kv": 2 * passes}
    assert code.proof().splitlines() == [
        f"--student: your code served: repeat_kv ×{2 * passes}, scaled_dot_product_attention ×{passes}, "
        f"causal_mask ×{passes}",
        "--student: yours, never called in this run: split_heads, merge_heads"]  # the model splits heads itself
    assert OFFSET in path.read_text()
    path.write_text(path.read_text().replace(OFFSET, "offset = 0"))
    buggy, _ = generate_with(tiny, student="01")
    assert buggy[0] == expected[0] and buggy != expected


@pytest.mark.parametrize("rung, calls_per_pass", [("1.1", {"causal_mask": 1}), ("1.2", {"repeat_kv": 2}),
                                                  ("1.3", {"scaled_dot_product_attention": 1})],
                         ids=["1.1", "1.2", "1.3"])
def test_a_finished_01_rung_serves_alone(tiny, exercises, rung, calls_per_pass):
    """One rung of chapter 01 done, two still stubs: the reference's attention runs in chapter 04's cache with the
    learner's rung — the learner's causal_mask (1.1) or repeat_kv (1.2) inside the reference's
    scaled_dot_product_attention, or the learner's (1.3) with the reference's mask and heads — token for token."""
    ladder = RUNGS["nanoserve.model.attention"]
    expected, _ = generate_with(tiny, student=False)
    finish("nanoserve.model.attention", ladder[rung])
    with pytest.warns(UserWarning, match=r"not finished in exercises/01-attention/attention\.py: the reference's "):
        tokens, code = generate_with(tiny, student="01")
    assert tokens == expected
    passes = len(expected) * tiny.config.num_hidden_layers
    assert dict(code.calls) == {name: n * passes for name, n in calls_per_pass.items()}
    lines = code.describe().splitlines()
    assert f"  yours      {', '.join(ladder[rung])}  from exercises/01-attention/attention.py" in lines
    assert sum(line.startswith("  reference  ") for line in lines) == 2  # the other two rungs


def test_finished_06_serves_and_untouched_05_falls_back(tiny, exercises):
    exercises("nanoserve.engine.scheduler")
    exercises("nanoserve.engine.model_runner")
    _, expected = serve(tiny)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, tokens = serve(tiny, student=["05", "06"])
    messages = [str(w.message) for w in caught]
    assert any("Exercise 5.1" in m for m in messages) and any("Exercise 5.2" in m for m in messages)
    assert not any("Exercise 6." in m for m in messages)
    assert tokens == expected
    assert type(engine.scheduler).__module__ == "student_nanoserve_engine_scheduler"
    assert type(engine.executor.workers[0].model_runner).__module__ == "student_nanoserve_engine_model_runner"
    assert type(engine.block_manager.allocator).__module__ == "nanoserve.kv.block_allocator"
    calls = engine.student.calls
    assert calls["Scheduler.schedule_waiting"] >= len(PROMPTS) and calls["ModelRunner.prepare_inputs"] >= len(PROMPTS)
    assert calls["Scheduler.preempt"] > 0 and calls["Scheduler.num_cached_tokens"] > 0  # the pool is small


def finish_rungs(path: Path, module: str, rungs: list[str]) -> None:
    """Write rungs of a ladder into the learner's file: each stub method replaced by the reference's own."""
    reference = importlib.import_module(module)
    source = path.read_text()
    for rung in rungs:
        for qualname in student.RUNGS[module][rung]:
            cls, name = qualname.split(".")
            start = source.index(f"    def {name}(")
            end = source.find("\n    def ", start + 1)
            body = inspect.getsource(getattr(getattr(reference, cls), name))
            source = source[:start] + body + (source[end + 1:] if end != -1 else "")
    path.write_text(source)


def test_finished_rungs_serve_and_the_unfinished_ones_fall_back(tiny, exercises):
    path = student.EXERCISES / STUDENT_FILES["nanoserve.engine.scheduler"]
    finish_rungs(path, "nanoserve.engine.scheduler", ["6.1", "6.2"])
    assert unfinished(path) == {"Exercise 6.3": ["Scheduler.schedule_running", "Scheduler.preempt",
                                                 "Scheduler.check_fits_alone"],
                                "Exercise 6.4": ["Scheduler.num_cached_tokens"]}
    _, expected = serve(tiny)
    with pytest.warns(UserWarning, match=r"Exercise 6\.3, Exercise 6\.4 not finished in .*scheduler\.py: the "
                                         r"reference's Scheduler\.check_fits_alone, .* runs instead, with your other"):
        engine, tokens = serve(tiny, student="06")
    assert tokens == expected
    assert type(engine.scheduler).__module__ == "student_nanoserve_engine_scheduler"
    calls = engine.student.calls
    assert calls["Scheduler.schedule_waiting"] >= len(PROMPTS) and calls["Scheduler.num_new_tokens"] > len(PROMPTS)
    assert "Scheduler.schedule_running" not in calls and "Scheduler.preempt" not in calls  # the reference's ran
    assert engine.block_manager.stats.hit_blocks > 0  # the reference's 6.4 found them
    lines = engine.student.describe().splitlines()
    assert ("  yours      Scheduler.schedule_waiting, Scheduler.num_new_tokens  "
            "from exercises/06-continuous-batching/scheduler.py") in lines
    assert ("  reference  Scheduler.schedule_running, Scheduler.preempt, Scheduler.check_fits_alone  "
            "(Exercise 6.3 not finished)") in lines
    assert "  reference  Scheduler.num_cached_tokens  (Exercise 6.4 not finished)" in lines
    assert any(line.startswith("  reference  nanoserve.engine.model_runner  (") and "Exercise 6.5" in line
               for line in lines)
    assert "Scheduler.schedule_waiting ×" in engine.student_proof()


def test_a_decode_engine_refuses_a_finished_6_1(tiny, exercises):
    """Chapter 17's decode engine loads each transferred prompt's K/V at admission, in the reference's
    schedule_waiting; rung 6.1 is not asked to (its stub says so), so with the learner's 6.1 the engine refuses, in
    one line, instead of serving without the transfer. With 6.1 unfinished the reference admits: accepted, and so is
    a prefill engine, whose admission is chapter 06's own."""
    from nanoserve.engine.config import KVTransferConfig

    def build(role):
        return LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, student="06",
                                             kv_transfer_config=KVTransferConfig(role)))

    with pytest.warns(UserWarning, match=r"Exercise 6\.1, .*not finished"):
        build("kv_consumer").close()
    finish_rungs(student.EXERCISES / STUDENT_FILES["nanoserve.engine.scheduler"], "nanoserve.engine.scheduler", ["6.1"])
    with pytest.raises(ValueError, match=r"^a decode engine .*not with your exercise 6\.1 \(student 06\)$"):
        build("kv_consumer")
    with pytest.warns(UserWarning, match=r"Exercise 6\.2, .*not finished"):
        build("kv_producer").close()


def test_a_half_finished_class_falls_back_naming_the_exercise(tiny, exercises):
    path = exercises("nanoserve.kv.block_allocator")
    source = path.read_text()
    start = source.index("    def free(")
    body = source.index('"""', source.index('"""', start) + 3) + 3  # after free's docstring
    end = source.index("\n    def ", body)
    path.write_text(source[:body] + '\n        raise NotImplementedError("Exercise 5.1: free")\n' + source[end:])
    assert unfinished(path) == {"Exercise 5.1": ["BlockAllocator.free"]}
    with pytest.warns(UserWarning, match=r"Exercise 5\.1 not finished in exercises/05-paged-kv/block_allocator\.py"):
        engine, _ = serve(tiny, student="05")
    assert type(engine.block_manager.allocator).__module__ == "nanoserve.kv.block_allocator"
    assert "BlockAllocator.free" in engine.student.describe()


def test_an_unselected_chapter_stays_reference(tiny, exercises):
    exercises("nanoserve.kv.block_allocator")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 06 is not asked for: no warning about it
        code = StudentCode("05")
        assert code.module("nanoserve.engine.scheduler").__name__ == "nanoserve.engine.scheduler"
        assert code.module("nanoserve.kv.block_allocator").__name__ == "student_nanoserve_kv_block_allocator"
    assert "none of your code ran" in StudentCode("06").proof()


@pytest.mark.slow
def test_batch_cli_serves_with_the_learners_allocator_and_says_so(smollm2, smollm2_tokenizer, exercises, tmp_path,
                                                                    monkeypatch, capsys):
    import json

    import nanoserve.model
    from nanoserve.cli import checks, main

    exercises("nanoserve.kv.block_allocator")
    exercises("nanoserve.kv.prefix_cache")
    monkeypatch.setattr(nanoserve.model, "load_gguf", lambda path=None, *rest: smollm2)  # (path, weights, quantizer)
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: smollm2_tokenizer)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}
    src.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")  # the second one hits the prefix cache
    assert main(["batch", "--input", str(src), "--output", str(dst), "--no-progress", "--num-blocks", "64",
                 "--student"]) == 0
    err = capsys.readouterr().err
    assert "yours      BlockAllocator  from exercises/05-paged-kv/block_allocator.py" in err
    assert "reference  nanoserve.engine.scheduler" in err and "Exercise 6.1 (Scheduler.schedule_waiting)" in err
    proof = [line for line in err.splitlines() if line.startswith("--student: your code served:")]
    assert len(proof) == 1 and "BlockAllocator.allocate ×" in proof[0] and "BlockAllocator.free ×" in proof[0]
    assert "prefix-cache hits: 0 blocks" not in proof[0]
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(results) == 2 and results[0]["token_ids"] == results[1]["token_ids"] and len(results[0]["token_ids"]) == 4


def test_a_finished_rung_serves_while_the_rest_of_its_ladder_falls_back(tiny, exercises, capsys):
    """Exercise 5.4 done, 5.3 (slot_mapping, build), 5.5 and 5.6 still stubs: the learner's allocate_slots runs
    the block manager, the reference's slot_mapping and paged attention the rest, token for token the same."""
    path = finish("nanoserve.kv.block_manager", ["BlockManager.allocate_slots", "BlockManager._register_full_blocks"])
    assert set(unfinished(path)) == {"Exercise 5.3"}
    _, expected = serve(tiny)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, tokens = serve(tiny, student="05")
    messages = [str(w.message) for w in caught]
    assert ("Exercise 5.3 not finished in exercises/05-paged-kv/block_manager.py: the reference's slot_mapping runs "
            "instead, with your other rungs") in messages
    assert any(m.startswith("Exercise 5.3, Exercise 5.5, Exercise 5.6 not finished in exercises/05-paged-kv/"
                            "paged_attention.py") for m in messages)
    assert tokens == expected
    assert type(engine.block_manager).__module__ == "student_nanoserve_kv_block_manager"
    assert engine.student.calls["BlockManager.allocate_slots"] >= len(PROMPTS)
    assert engine.block_manager.stats.hit_blocks > 0  # the learner's prefix hits, in the real engine
    err = capsys.readouterr().err
    assert "yours      BlockManager.allocate_slots  from exercises/05-paged-kv/block_manager.py" in err
    assert "reference  slot_mapping  (Exercise 5.3 not finished)" in err


def test_finished_metadata_and_paged_attention_serve_with_the_decode_group_stubbed(tiny, exercises):
    """5.3 (both halves) and 5.5 done, 5.4 and 5.6 not: the learner's build calls the learner's slot_mapping
    (from block_manager.py), the learner's PagedAttention runs every layer with the reference's DecodeGroup."""
    finish("nanoserve.kv.block_manager", ["slot_mapping"])
    finish("nanoserve.kv.paged_attention", RUNGS["nanoserve.kv.paged_attention"]["5.3"]
           + RUNGS["nanoserve.kv.paged_attention"]["5.5"])
    _, expected = serve(tiny)
    with pytest.warns(UserWarning, match=r"Exercise 5\.6 not finished in exercises/05-paged-kv/paged_attention\.py"):
        engine, tokens = serve(tiny, student="05")
    assert tokens == expected
    runner = engine.executor.workers[0].model_runner
    assert runner.attention.__module__ == runner.metadata.__module__ == "student_nanoserve_kv_paged_attention"
    calls = engine.student.calls
    steps = calls["AttentionMetadata.build"]
    assert steps > len(PROMPTS) and calls["slot_mapping"] >= steps  # one per sequence and step
    assert calls["PagedAttention.__call__"] == steps * tiny.config.num_hidden_layers
    assert calls["attend_sequence"] > 0 and calls["gather_kv"] == 2 * calls["attend_sequence"]
    assert "DecodeGroup.attend" not in calls  # the reference's: not counted as the learner's


def test_all_of_chapter_05_serves(tiny, exercises):
    """Every rung of 05 finished: no warning, and each of the learner's files is called in the real engine."""
    for module in [m for m, path in STUDENT_FILES.items() if path.startswith("05-")]:
        exercises(module)
    _, expected = serve(tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, tokens = serve(tiny, student="05")
    assert tokens == expected
    calls = engine.student.calls
    for name in ["BlockAllocator.allocate", "PrefixCache.get", "BlockManager.allocate_slots", "slot_mapping",
                 "AttentionMetadata.build", "attend_sequence", "DecodeGroup.attend"]:
        assert calls[name] > 0, name


def test_all_of_chapter_05_serves_on_a_bf16_pool(tiny, exercises):
    """`serve`'s default pool is bf16, here under a model whose q, k, v are float32: the learner's PagedAttention
    and DecodeGroup store and attend in the pool's dtype and hand the model back float32, token for token as the
    reference does."""
    for module in [m for m, path in STUDENT_FILES.items() if path.startswith("05-")]:
        exercises(module)
    engine, expected = serve(tiny, kv_cache_dtype="bf16")
    assert engine.executor.workers[0].model_runner.kv_cache.k_cache[0].dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, tokens = serve(tiny, student="05", kv_cache_dtype="bf16")
    assert tokens == expected
    assert engine.student.calls["PagedAttention.__call__"] > 0 and engine.student.calls["DecodeGroup.attend"] > 0


@pytest.mark.parametrize("rung", ["7.1", "7.3", "7.4"])
def test_a_finished_kernel_rung_serves_inside_the_reference_kernel(tiny, exercises, rung):
    """One rung of the paged kernel done (and 7.2, store-KV), the other two not: the engine's triton backend
    launches the learner's jit function with the reference's other two, token for token the same."""
    module = "nanoserve.kernels.triton_paged_attention"
    ladder = RUNGS[module]
    finish(module, ladder[rung])
    exercises("nanoserve.kernels.triton_store_kv")
    _, expected = serve(tiny, attention_backend="triton")
    rest = sorted(r for r in ladder if r != rung)
    with pytest.warns(UserWarning, match=rf"Exercise {rest[0]}, Exercise {rest[1]} not finished in "
                                         r".*triton_paged_attention\.py: the reference's"):
        engine, tokens = serve(tiny, attention_backend="triton", student="07")
    assert tokens == expected
    learner, reference = engine.student.modules[module], importlib.import_module(module)
    for r, (name,) in ladder.items():
        assert (getattr(learner, name) is getattr(reference, name)) == (r != rung), name  # the learner's, compiled in
    # the run's report names the finished rung's jit function as the learner's
    yours = next(line for line in engine.student.describe().splitlines()
                 if line.startswith("  yours") and "triton_paged_attention.py" in line)
    named = yours.split("yours", 1)[1].split("  from ")[0].strip().split(", ")
    assert {name for (name,) in ladder.values()} & set(named) == set(ladder[rung]), yours
    assert "store_kv_kernel" in next(line for line in engine.student.describe().splitlines()
                                     if line.startswith("  yours") and "triton_store_kv.py" in line)  # 7.2
    calls = engine.student.calls
    assert calls["paged_attention"] == calls["store_kv"] > len(PROMPTS) * tiny.config.num_hidden_layers


def test_finished_03_and_04_run_the_generate_loop(tiny, exercises):
    """`generate --student 03,04`: the learner's sampler, detokenizer, stop check and KV cache run chapter 03's loop
    with chapter 04's cache, and give the reference's tokens and text exactly (a seeded, filtered draw)."""
    from nanoserve.generate import generate
    from nanoserve.text.tokenizer import Tokenizer

    for module in ("nanoserve.sampling", "nanoserve.text.detokenizer", "nanoserve.text.stop", "nanoserve.kv.naive"):
        exercises(module)
    tok = Tokenizer.from_gguf()
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)
    prompt = [72, 105, 33, 10, 200, 201]
    expected = generate(tiny, prompt, params, tok.eos_token_id, tok, use_cache=True)
    code = StudentCode("03,04")
    out = generate(tiny, prompt, params, tok.eos_token_id, tok, use_cache=True, modules=code.module)
    assert out == expected and len(out.token_ids) == 10 and len(set(out.token_ids)) > 1
    calls = code.calls
    assert calls["sample"] == calls["check_stop"] == calls["IncrementalDetokenizer.add"] == 10
    # one forward per token (the prefill, then 9 decode steps), each calling the cache once per layer
    assert calls["NaiveKVCache.__call__"] == 10 * tiny.config.num_hidden_layers
    lines = code.describe().splitlines()
    for file in ("03-tokens-and-sampling/sampling.py", "03-tokens-and-sampling/stop.py",
                 "03-tokens-and-sampling/detokenizer.py", "04-kv-cache/naive.py"):
        assert any(line.startswith("  yours ") and line.endswith(file) for line in lines), (file, lines)


def test_finished_03_draws_every_token_of_the_engine(tiny, exercises):
    """`batch --student 03`: the engine hands every sequence's rows to the learner's sample_batch (one call per
    sequence and step; a request with n = 2 draws both first tokens in one call) — greedy, seeded and filtered,
    penalised and min-p requests alike — and every completion gets the reference engine's tokens exactly. The
    learner's sampler is the exercise's, which knows nothing of min-p: the engine applies it before the call."""
    path = exercises("nanoserve.sampling")
    line = "    logits = min_p_filter(logits, params.min_p)"
    assert line in path.read_text()
    path.write_text("".join(l for l in path.read_text().splitlines(keepends=True) if not l.startswith(line)))
    requests = {"greedy": dict(temperature=0), "filtered": dict(temperature=0.9, top_k=40, top_p=0.9, seed=5),
                # a few tokens stand out (the bias) and min-p keeps only the top two: without it, the other 253 win
                "min-p": dict(temperature=1.0, min_p=0.3, logit_bias={3: 4.0, 5: 3.0, 9: 2.0}, presence_penalty=0.1,
                              seed=6),
                "pair": dict(temperature=1.0, seed=7, n=2)}

    def run(student) -> tuple[LLMEngine, dict]:
        engine = LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, student=student))
        for i, (name, params) in enumerate(requests.items()):
            engine.add_request(name, PROMPTS[i], SamplingParams(max_tokens=6, ignore_eos=True, **params))
        tokens = {}
        while engine.has_unfinished_requests():
            tokens.update({(out.request_id, out.index): out.token_ids for out in engine.step() if out.finish_reason})
        return engine, tokens

    _, expected = run(False)
    # the detokenizer and the stop check: the reference's
    with pytest.warns(UserWarning, match=r"Exercise 3\.2 not finished"), \
            pytest.warns(UserWarning, match=r"Exercise 3\.3 not finished"):
        engine, tokens = run("03")
    assert tokens == expected and len(tokens) == 5
    assert len({tuple(t) for t in tokens.values()}) == 5  # the draws differ: the seeds and filters were used
    assert set(tokens["min-p", 0]) <= {3, 5}  # min-p applied: without it the other 253 tokens hold most mass
    calls = engine.student.calls
    assert calls["probabilities"] > 0 and calls["min_p_filter"] == 0  # the learner's sampler never applied min-p
    # 6 tokens each for 3 requests, and the pair's 2 first tokens in one call, then 5 more each: 29 calls, 30 rows
    assert calls["sample_batch"] == 3 * 6 + 1 + 2 * 5 and calls["sample"] == 3 * 6 + 2 + 2 * 5


def test_finished_03_detokenizes_and_stops_the_engines_requests(tiny, exercises):
    """`batch --student 03` with 3.2 and 3.3 done: the engine streams every request's text through the learner's
    IncrementalDetokenizer and ends each request by the learner's check_stop — a stop string (the text cut before
    it), a stop token id, max_tokens — with the reference engine's tokens, text and finish exactly; the run's report
    names both files as the learner's, and check_stop ran once per token."""
    from nanoserve.text.tokenizer import Tokenizer

    for module in ("nanoserve.sampling", "nanoserve.text.detokenizer", "nanoserve.text.stop"):
        exercises(module)
    tok = Tokenizer.from_gguf()

    def run(student, stops: dict) -> tuple[LLMEngine, dict]:
        engine = LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, student=student), tokenizer=tok)
        for i, name in enumerate(["string", "id", "length"]):
            engine.add_request(name, PROMPTS[i], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                **stops.get(name, {})))
        got = {}
        while engine.has_unfinished_requests():
            got.update({out.request_id: (out.token_ids, out.text, out.finish_reason) for out in engine.step()
                        if out.finished})
        return engine, got

    _, free = run(False, {})  # no stops: where a stop string and a stop id will be met
    full_text, full_ids = free["string"][1], free["id"][0]
    stop_string = full_text[2:4]
    stops = {"string": {"stop": [stop_string]}, "id": {"stop_token_ids": [full_ids[3]]}}
    _, expected = run(False, stops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every file of chapter 03 is finished: nothing falls back
        engine, got = run("03", stops)
    assert got == expected
    assert got["string"][1:] == (full_text[:full_text.index(stop_string)], "stop")  # cut before the stop string
    assert got["id"][0] == full_ids[:full_ids.index(full_ids[3]) + 1] and got["id"][2] == "stop"
    assert got["length"] == free["length"] and got["length"][2] == "length" and len(got["length"][0]) == 8
    calls = engine.student.calls
    assert calls["check_stop"] == sum(len(ids) for ids, _, _ in got.values())  # once per token, every request
    assert calls["IncrementalDetokenizer.add"] > 0 and calls["find_stop_string"] > 0
    lines = engine.student.describe().splitlines()
    for name, file in (("IncrementalDetokenizer", "detokenizer.py"), ("check_stop", "stop.py")):
        assert any(line.startswith("  yours ") and name in line and line.endswith("03-tokens-and-sampling/" + file)
                   for line in lines), (name, lines)


@pytest.mark.parametrize("finished, yours, fallback, calls", [
    # the CLI and the reference's memory_plan call kv_bytes_per_sequence once each, and kv_bytes_per_token once
    # each directly and once each through kv_bytes_per_sequence
    (["4.2"], "kv_bytes_per_token, kv_bytes_per_sequence", "memory_plan  (Exercise 4.3",
     "kv_bytes_per_token ×4, kv_bytes_per_sequence ×2"),
    # the learner's memory_plan makes the plan, on the reference's 4.2 beneath it
    (["4.3"], "memory_plan", "kv_bytes_per_token, kv_bytes_per_sequence  (Exercise 4.2", "memory_plan ×1"),
    (["4.2", "4.3"], "kv_bytes_per_token, kv_bytes_per_sequence, memory_plan", None,
     "kv_bytes_per_token ×4, kv_bytes_per_sequence ×2, memory_plan ×1"),
], ids=["4.2", "4.3", "4.2+4.3"])
def test_memory_cli_runs_the_learners_finished_rungs(finished, yours, fallback, calls, exercises, capsys):
    """`memory --student 04` with some rungs finished: the learner's functions make the plan the CLI prints (the
    reference's numbers: 113 sequences), an unfinished rung falls back with a warning, and stderr says which."""
    from nanoserve.cli import main

    args = ["memory", "--model", "llama-3-8b", "--device-gb", "80", "--seq-len", "4096"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    path = finish("nanoserve.memory", [name for rung in finished for name in RUNGS["nanoserve.memory"][rung]])
    assert set(unfinished(path)) == {f"Exercise {rung}" for rung in ("4.2", "4.3") if rung not in finished}
    if fallback:
        with pytest.warns(UserWarning, match=r"Exercise 4\.[23] not finished in exercises/04-kv-cache/memory\.py"):
            assert main(args + ["--student", "04"]) == 0
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every rung is the learner's: nothing falls back
            assert main(args + ["--student", "04"]) == 0
    out, err = capsys.readouterr()
    assert out == expected
    assert f"  yours      {yours}  from exercises/04-kv-cache/memory.py" in err
    assert (f"  reference  {fallback}" in err) if fallback else "  reference  " not in err
    assert f"--student: your code served: {calls}\n" in err, err


@pytest.mark.slow
def test_generate_cli_runs_the_learners_chapter_03_and_says_so(smollm2, smollm2_tokenizer, exercises, monkeypatch,
                                                                  capsys):
    import json

    import nanoserve.model
    from nanoserve.cli import checks, main

    monkeypatch.setattr(nanoserve.model, "load_gguf", lambda path=None, *rest, **kw: smollm2)  # (path, weights, modules=)
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: smollm2_tokenizer)
    args = ["generate", "--prompt", "Name a colour.", "--chat", "--temperature", "0", "--max-tokens", "6", "--json"]
    assert main(args) == 0
    expected = json.loads(capsys.readouterr().out)
    exercises("nanoserve.sampling")
    exercises("nanoserve.text.stop")
    with pytest.warns(UserWarning, match=r"Exercise 3\.2 not finished in exercises/03-tokens-and-sampling/detokeniz"):
        assert main(args + ["--student", "03"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == expected
    lines = err.splitlines()
    for name, file in (("top_p_filter", "sampling.py"), ("check_stop", "stop.py")):
        assert any(line.startswith("  yours ") and name in line and line.endswith("03-tokens-and-sampling/" + file)
                   for line in lines), (name, lines)
    assert any(line.startswith("  reference  nanoserve.text.detokenizer  (") for line in lines)
    proof = [line for line in err.splitlines() if line.startswith("--student: your code served:")]
    assert len(proof) == 1 and "sample ×6" in proof[0] and "check_stop ×6" in proof[0]


@pytest.mark.slow
def test_generate_cli_serves_chapter_01_as_its_readme_says(smollm2, smollm2_tokenizer, exercises, monkeypatch,
                                                           capsys):
    """The command of exercises/01-attention/README.md, with the reference as the learner's file, prints what the
    README quotes (the reply, then the report), line for line; with the classic bug (offset = 0) the reply changes
    to the one the README quotes."""
    import re
    import shlex

    import nanoserve.model
    from nanoserve.cli import checks, main

    monkeypatch.setattr(nanoserve.model, "load_gguf", lambda path=None, *rest, **kw: smollm2)  # (path, weights, modules=)
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: smollm2_tokenizer)
    readme = (Path(__file__).resolve().parent.parent / "exercises/01-attention/README.md").read_text()
    args = shlex.split(re.search(r"python -m nanoserve (generate .* --student 01)\n", readme).group(1))
    quoted = re.search(r"```\n([^`]*--student: your code served: [^`]*)```", readme).group(1)
    path = exercises("nanoserve.model.attention")
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out + err == quoted  # on a terminal: the reply (stdout), then the report (stderr)
    path.write_text(path.read_text().replace(OFFSET, "offset = 0"))
    assert main(args) == 0
    buggy = capsys.readouterr().out.rstrip("\n")
    assert buggy != out.rstrip("\n") and f"`{buggy}`" in readme


@pytest.mark.parametrize("rungs", [["12.1"], ["12.2"], ["12.3"], ["12.4"], ["12.1", "12.2", "12.3", "12.4"]])
def test_finished_12_feeds_the_live_page(tiny, exercises, rungs):
    """--student 12, rung by rung: the async engine's event feed is the learner's where 12.3 / 12.4 are finished,
    and draws the pool and the step timeline with the learner's block_owners (12.1) and step_kind (12.2) where
    finished; each unfinished rung is the reference's. Snapshot for snapshot, the feed sends what the reference's
    sends for the same schedule (times aside), and each finished function of the learner's served every step."""
    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.engine.event_feed import EventFeed

    files = {"nanoserve.engine.snapshot": [], "nanoserve.engine.event_feed": []}
    for module, ladder in files.items():
        for rung in rungs:
            ladder += student.RUNGS[module].get(rung, [])
        finish(module, ladder)
    config = dict(num_blocks=11, block_size=4, max_num_batched_tokens=16)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        engines = [LLMEngine(tiny, engine_config(**config, student="12")), LLMEngine(tiny, engine_config(**config))]
        feeds = [AsyncLLMEngine(engines[0]).event_feed, EventFeed()]
        subs = [feed.subscribe() for feed in feeds]
        for engine, feed in zip(engines, feeds):
            feed.min_interval = 0  # a snapshot after every step, on both sides
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        seen = [[], []]
        while engines[1].has_unfinished_requests():
            for engine, feed, sub, got in zip(engines, feeds, subs, seen):
                outputs = engine.step()
                feed.record(engine, engine.last_scheduler_output, outputs, 0.001)
                snap = sub.take()
                got.append((snap["pool"], [r[:1] + r[2:5] + r[6:] for r in snap["steps"]], snap["preempted"]))
    assert seen[0] == seen[1] and any(preempted for _, _, preempted in seen[0])  # 5 requests on 11 blocks preempt
    ours = files["nanoserve.engine.event_feed"]
    assert type(feeds[0]).__module__ == ("student_nanoserve_engine_event_feed" if ours else "nanoserve.engine.event_feed")
    calls, steps = engines[0].student.calls, len(seen[0])
    lines = engines[0].student.describe().splitlines()
    for module, done in files.items():
        path = f"exercises/{STUDENT_FILES[module]}"
        if not done:  # no rung of the file finished: the reference's module, whole
            assert any(line.startswith(f"  reference  {module}  ({path} still raises") for line in lines)
            continue
        (yours,) = [line for line in lines if line.startswith("  yours      ") and line.endswith(f"  from {path}")]
        for rung, names in student.RUNGS[module].items():
            if rung in rungs:  # the learner's served, every step (step_kind: once per scheduled sequence)
                assert all(name in yours for name in names)
                assert all(calls[name] >= steps if name == "step_kind" else calls[name] == steps for name in names)
            else:  # the reference's ran in its place, and the run says so
                assert not set(names) & set(calls)
                assert f"  reference  {', '.join(names)}  (Exercise {rung} not finished)" in lines
    assert len(rungs) < 4 or not any("not finished" in str(w.message) for w in warned)  # all four: no fallback


SCHEMA_13 = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "c": {"enum": ["red", "green"]}}, "required": ["n", "c"]}
CHOICES_13 = ["red", "green", "not sure"]


@pytest.mark.parametrize("module, called, yours", [
    ("nanoserve.structured.choice", "choice_mask", "build_trie, choice_mask"),
    ("nanoserve.structured.bitmask", "apply_token_bitmask", "unpack_bitmask, apply_token_bitmask"),
    ("nanoserve.structured.matcher", "SequenceMatcher.sync", "SequenceMatcher"),
])
def test_finished_13_constrains_every_token(exercises, smollm2_tokenizer, module, called, yours):
    """--student 13 with one rung finished: every constrained token went through the learner's code (13.1 the
    choice list's masks from the trie, 13.2 the mask applied to the logits, 13.3 the matcher synced to the
    sequence), the other rungs fall back; the output follows its grammar (a JSON schema; for 13.1 a choice list)
    and equals the reference run's token for token."""
    import json

    import jsonschema

    from nanoserve.structured import StructuredOutputsParams

    tiny = tiny_llama(vocab_size=49152)  # random weights, SmolLM2's vocabulary: the tokenizer's masks fit
    exercises(module)
    choice = module.endswith("choice")
    structured = StructuredOutputsParams(choice=CHOICES_13) if choice else StructuredOutputsParams(json=SCHEMA_13)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured=structured)
    with pytest.warns(UserWarning, match=r"Exercise 13\.[123] not finished"):
        engines = [LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32),
                                                student="13"), smollm2_tokenizer)]
    engines.append(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32)), smollm2_tokenizer))
    texts = []
    for engine in engines:
        engine.add_request("r", smollm2_tokenizer.encode("A colour and a number:"), params)
        while engine.has_unfinished_requests():
            texts += [(out.token_ids, out.text) for out in engine.step() if out.finished]
    assert texts[0] == texts[1]
    if choice:
        assert texts[0][1] in CHOICES_13
    else:
        jsonschema.validate(json.loads(texts[0][1]), SCHEMA_13)
    steps = len(texts[0][0])
    calls = engines[0].student.calls
    assert calls[called] >= steps  # one call a sampled token, at least
    if choice:  # one trie per request; every node's mask computed when the list compiles (at least one a token)
        assert calls["build_trie"] == 1
    assert f"yours      {yours}  from exercises/{STUDENT_FILES[module]}" in engines[0].student.describe()


def test_finished_14_speculates_with_the_learners_code(tiny, exercises):
    """--student 14 with every rung finished: the learner's n-gram proposer proposes (14.1), the learner's rules
    accept, greedy (14.2) and sampled (14.3), and the learner's rollback gives the rejected slots back (14.4), in
    the real engine; greedy outputs equal the reference run's token for token; seeded sampled ones (a learner's
    rule may draw its random numbers in another order than the reference and still be exact) come out the same
    twice under the learner's code and run to their max_tokens; the pool ends whole."""
    from tests.test_ch14_spec_decode import requests

    for module in [m for m, path in STUDENT_FILES.items() if path.startswith("14-")]:
        exercises(module)
    reqs = requests(6)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=m, ignore_eos=True)
              for i, (_, m) in enumerate(reqs)]

    def go(selection):
        engine = LLMEngine(tiny, engine_config(num_blocks=128, block_size=4, speculative="ngram",
                                               speculative_disable_by_batch_size=None, student=selection))
        for i, (prompt, _) in enumerate(reqs):
            engine.add_request(str(i), prompt, params[i])
        tokens = {}
        while engine.has_unfinished_requests():
            tokens.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
        assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
        return engine, tokens

    _, expected = go(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every rung finished: no fallback
        engine, tokens = go("14")
        _, again = go("14")
    greedy = [str(i) for i in range(len(reqs)) if i % 2]
    assert {i: tokens[i] for i in greedy} == {i: expected[i] for i in greedy}
    assert tokens == again and all(len(tokens[str(i)]) == m for i, (_, m) in enumerate(reqs))
    calls, s = engine.student.calls, engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # accepted some, rolled back others
    assert calls["NgramProposer.propose"] >= s.num_drafts
    assert calls["greedy_accept"] + calls["rejection_sample"] == s.num_drafts
    assert calls["greedy_accept"] > 0 and calls["rejection_sample"] > 0 and calls["residual"] > 0
    assert calls["rollback_slots"] > 0
    described = engine.student.describe()
    for name in ["NgramProposer", "greedy_accept, residual, rejection_sample", "rollback_slots"]:
        assert name in described


def test_finished_15_slo_orders_preempts_and_rejects(tiny, exercises):
    """--student 15 with the slo policy: the learner's deadline (15.1), laxity (15.2), victim (15.3) and
    rejection (15.4) schedule a run that must preempt (5 requests of 17 tokens on 12 blocks of 4, no prefix cache) and refuse
    one request that arrived a second ago wanting its first token within 10 ms; the others' tokens equal a
    reference run's, and every block comes back."""
    import time

    from nanoserve.engine.policies import SLOTargets

    finish("nanoserve.engine.policies.slo", ["next_token_deadline", "SLOPolicy.laxity", "SLOPolicy.choose_victim",
                                             "SLOPolicy.reject_reason"])
    config = dict(num_blocks=12, block_size=4, enable_prefix_caching=False, scheduling_policy="slo",
                  slo_ttft_ms=60_000, slo_tpot_ms=60_000, slo_reject=True)
    engines = [LLMEngine(tiny, engine_config(**config, student="15")), LLMEngine(tiny, engine_config(**config))]
    assert type(engines[0].scheduler.policy).__module__ == "student_nanoserve_engine_policies_slo"
    results = []
    for engine in engines:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2), arrival_time=time.perf_counter() - 1.0,
                           slo=SLOTargets(ttft_ms=10))
        done, preempted = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.reject_reason)
            preempted += len(engine.last_scheduler_output.preempted_seq_ids)
        assert preempted > 0 and engine.block_manager.get_num_free_blocks() == 12
        results.append(done)
    assert results[0] == results[1]
    assert results[0]["late"][0] == [] and results[0]["late"][1].startswith("TTFT deadline lost")
    calls = engines[0].student.calls
    assert calls["next_token_deadline"] > 0 and calls["SLOPolicy.laxity"] > 0
    assert calls["SLOPolicy.choose_victim"] > 0 and calls["SLOPolicy.reject_reason"] > 0
    assert "yours      next_token_deadline, SLOPolicy.deadline, SLOPolicy.laxity" in engines[0].student.describe()


def test_finished_15_fair_charges_each_tenant_its_tokens_over_its_weight(tiny, exercises):
    """--student 15 with the fair policy: the learner's fair_order (15.5) orders, its on_scheduled and catch_up
    (15.6) keep the virtual times. Both tenants busy from the first step, no preemption: each tenant's virtual
    time is the tokens its requests computed (prompt + outputs - 1 each: the last token is sampled, never fed
    back; no prefix cache, so no prompt is skipped) over its weight — 3 requests of 11 + 6 - 1 = 16 tokens for a (weight 2): 24; 2 for b: 32."""
    finish("nanoserve.engine.policies.fair", ["fair_order", "FairPolicy.catch_up", "FairPolicy.on_scheduled"])
    engine = LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                           enable_prefix_caching=False, scheduling_policy="fair",
                                           tenant_weights={"a": 2.0}, student="15"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           tenant="a" if i % 2 == 0 else "b")
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert sorted(finished) == ["0", "1", "2", "3", "4"]
    assert engine.scheduler.policy.virtual_time == {"a": 24.0, "b": 32.0}
    calls = engine.student.calls
    assert calls["fair_order"] > 0 and calls["FairPolicy.on_scheduled"] > 0 and calls["FairPolicy.catch_up"] > 0


def test_student_15_under_a_policy_that_asks_nothing_says_which_flag_plugs_it_in(tiny, exercises):
    """--student 15 with the default policy (priority): none of chapter 15's code runs, and the notice names the
    flag that would make it run."""
    finish("nanoserve.engine.policies.fair", ["fair_order", "FairPolicy.catch_up", "FairPolicy.on_scheduled"])
    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, student="15"))
    lines = engine.student.describe().splitlines()
    assert any("add --scheduling-policy slo or fair" in line for line in lines), lines
    fair = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, scheduling_policy="fair", student="15"))
    assert "--scheduling-policy" not in fair.student.describe()


def test_student_08_in_the_engine_points_to_the_server_and_idle_chapters_name_their_grade_command(tiny):
    """--student 08 under the engine alone (`batch`, or `serve` before its server starts): no line says that chapter
    08 plugs into nothing — it plugs into the server — and a chapter with no exercise in the run is named with the
    very command that grades it."""
    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, student="08"))
    assert engine.student.describe().splitlines() == [
        "--student 08: the engine runs",
        "  (chapter 08's code runs only behind the HTTP server: serve --student 08 lists it when the server starts)"]
    lines = StudentCode("01,08,11").describe().splitlines()  # nothing loaded yet: every chapter idle
    assert lines[1:] == [
        "  (no exercise of chapter 01, 11 plugs into this run: grade them with make grade CH=01, make grade CH=11)",
        "  (chapter 08's code runs only behind the HTTP server: serve --student 08 lists it when the server starts)"]
    assert StudentCode("11").describe().splitlines()[1] == \
        "  (no exercise of chapter 11 plugs into this run: grade it with make grade CH=11)"


def test_student_07_with_the_torch_backend_says_which_flag_plugs_it_in(tiny):
    """--student 07 with the torch attention backend (the CPU's default): none of chapter 07's kernels run, and the
    notice names the flag (and, on a CPU, the interpreter) that would make them run."""
    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, student="07"))
    assert engine.attention_backend == "torch"
    lines = engine.student.describe().splitlines()
    assert any("add --attention-backend triton" in line and "TRITON_INTERPRET=1" in line for line in lines), lines


def test_finished_17_receives_into_its_own_slots(exercises):
    """--student 17, rung 17.1: the decode engine plans each transferred prompt's load with the learner's
    num_tokens_to_receive and receive_slots; its greedy tokens are a colocated engine's."""
    from nanoserve.engine.config import KVTransferConfig

    exercises("nanoserve.disagg.receive")
    model = tiny_llama(vocab_size=97)
    config = dict(block_size=4, num_blocks=32, max_num_batched_tokens=8)
    prefill = LLMEngine(model, engine_config(**config, kv_transfer_config=KVTransferConfig("kv_producer")))
    decode = LLMEngine(model, engine_config(**config, student="17", kv_transfer_config=KVTransferConfig("kv_consumer")))
    plain = LLMEngine(model, engine_config(**config))
    try:
        for i, prompt in enumerate([list(range(3, 17)), list(range(3, 13)) + [40, 41]]):
            got = []
            for engine, extra in ((prefill, {"kv_transfer_params": {"do_remote_decode": True}}), (decode, None),
                                  (plain, {})):
                if extra is None:
                    extra = {"kv_transfer_params": got[0].kv_transfer_params}
                n = 1 if engine is prefill else 6
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n), **extra)
                while engine.has_unfinished_requests():
                    got += [o for o in engine.step() if o.finished]
            assert got[1].token_ids == got[2].token_ids
        calls = decode.student.calls
        assert calls["num_tokens_to_receive"] == 2 and calls["receive_slots"] == 2
        assert "receive.py" in decode.student.describe()
    finally:
        prefill.close(), decode.close()


@pytest.mark.parametrize("rung", ["17.2", "17.3"])
def test_finished_17_routes_by_the_learners_index(exercises, rung):
    """--student 17 with one rung of kv_index.py finished: the KV-aware router of the kv-routing experiment runs
    the learner's index (17.2) or score (17.3), the other rung the reference's; every request is placed where
    the reference router places it (the same hit rate, the same requests per replica)."""
    from types import SimpleNamespace

    from nanoserve.bench.kv_routing import run_one
    from nanoserve.student import RUNGS, StudentCode

    finish("nanoserve.disagg.kv_index", RUNGS["nanoserve.disagg.kv_index"][rung])
    model = tiny_llama(vocab_size=97)
    systems = [list(range(5 + 9 * u, 5 + 9 * u + 16)) for u in range(4)]
    prompts = [systems[u] + [60 + t] for t in range(3) for u in range(4)]
    args = SimpleNamespace(replicas=2, num_blocks=24, num_users=2, output_len=2)
    student = StudentCode("17")
    theirs = run_one("kv-aware, fresh", model, None, prompts, args, student)
    ours = run_one("kv-aware, fresh", model, None, prompts, args)
    assert theirs["requests_per_replica"] == ours["requests_per_replica"]
    assert theirs["hit_tokens"] == ours["hit_tokens"] > 0
    names = RUNGS["nanoserve.disagg.kv_index"][rung]
    assert all(student.calls[name] > 0 for name in names), student.calls
