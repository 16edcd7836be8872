"""Swap the learner's exercise code in for the reference code.

Every exercise file under `exercises/` mirrors one reference module (same names, same
signatures). Two users:

- the grader: tests ask `implementation("nanoserve.model.attention")` for the module they grade,
  the reference or — with NANOSERVE_IMPL=student, as `make grade` sets it — the learner's file;
- a real run (`--student`, `LLM(student=...)`): `StudentCode(selection).module(name)` gives the
  learner's module where its chapter is selected and its file is finished, else the reference.

A file is finished when no `raise NotImplementedError("Exercise N.M: …")` is left in it: every
stub marks itself unfinished, so a class whose constructor works but whose `free()` is still a stub
falls back as a whole (with a warning that names Exercise 5.1). Nothing is probed by calling it.

A file that holds a ladder of exercises (RUNGS: chapter 06's scheduler is 6.1 admission, 6.2
chunking, …) is judged rung by rung instead: the learner's finished rungs serve and each rung still
stubbed is swapped for the reference's functions (a swapped module-level function calls the learner's
finished ones: chapter 01's reference attention masks with the learner's causal_mask); and under a
graded test of rung 6.2 the grader takes the learner's 6.2 with the reference's other rungs, so every
rung is graded on its own. A rung can span files (chapter 05's 5.3 is slot_mapping in block_manager.py
and AttentionMetadata.build in paged_attention.py): in a real run a learner's file that imports a function
of another exercise module of its chapter is given that module's version as the run serves it, so the
learner's files call each other. So a file whose given code builds objects of a class from another file of
its chapter (chapter 02's block.py builds its norms from layers.py's RMSNorm) serves even before its own rung
is done: the reference's functions run in the learner's file, whose norms are then the learner's finished
RMSNorm, not the reference's.

    code = StudentCode("05")               # True = every chapter; "05,06"; ["05"]; False = none
    allocator = code.module("nanoserve.kv.block_allocator").BlockAllocator(64)
    print(code.describe())                 # whose code runs, from which file
    ...                                    # serve requests
    print(code.proof())                    # how often the learner's functions were called, and which were not

Registering a new exercise (chapters 07, 08, …) is two edits, both obvious:
  1. add `"nanoserve.x.y": "NN-slug/y.py"` to STUDENT_FILES below (the grader and the API check
     in tests/test_exercises.py pick it up from there);
  2. if the file holds several exercises that can each be done alone, list each one's functions in
     RUNGS (reference qualnames: "Scheduler.schedule_waiting");
  3. to let it serve for real, the code that uses the module asks for it through the run's
     StudentCode instead of importing it: `self.student.module("nanoserve.x.y").Thing(...)`
     (see LLMEngine.__init__). That is all: the fallback, the report and the call counts come free.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import types
import warnings
from collections import Counter
from pathlib import Path
from types import ModuleType

EXERCISES = Path(__file__).resolve().parent.parent / "exercises"

# reference module -> the learner's file that mirrors it
STUDENT_FILES = {
    "nanoserve.model.attention": "01-attention/attention.py",
    "nanoserve.model.layers": "02-the-model/layers.py",
    "nanoserve.model.block": "02-the-model/block.py",
    "nanoserve.model.llama": "02-the-model/llama.py",
    "nanoserve.kv.naive": "04-kv-cache/naive.py",
    "nanoserve.memory": "04-kv-cache/memory.py",
    "nanoserve.kv.block_allocator": "05-paged-kv/block_allocator.py",
    "nanoserve.kv.prefix_cache": "05-paged-kv/prefix_cache.py",
    "nanoserve.engine.scheduler": "06-continuous-batching/scheduler.py",
    "nanoserve.sampling": "03-tokens-and-sampling/sampling.py",
    "nanoserve.text.detokenizer": "03-tokens-and-sampling/detokenizer.py",
    "nanoserve.text.stop": "03-tokens-and-sampling/stop.py",
    "nanoserve.server.request_params": "08-http-serving/request_params.py",
    "nanoserve.server.streaming": "08-http-serving/streaming.py",
    "nanoserve.engine.async_engine": "08-http-serving/async_engine.py",
    "nanoserve.server.limits": "08-http-serving/limits.py",
    "nanoserve.kernels.triton_paged_attention": "07-triton-paged-attention/triton_paged_attention.py",
    "nanoserve.kernels.triton_store_kv": "07-triton-paged-attention/triton_store_kv.py",
    "nanoserve.model.quant": "10-quantization/quant.py",
    "nanoserve.metrics": "09-measuring/metrics.py",
    "nanoserve.bench.load": "09-measuring/load.py",
    "nanoserve.distributed.linear": "11-tensor-parallel/linear.py",
    "nanoserve.distributed.shard": "11-tensor-parallel/shard.py",
    "nanoserve.distributed.vocab": "11-tensor-parallel/vocab.py",
    "nanoserve.distributed.parallel_state": "11-tensor-parallel/parallel_state.py",
    "nanoserve.engine.snapshot": "12-engine-view/snapshot.py",
    "nanoserve.engine.event_feed": "12-engine-view/event_feed.py",
    "nanoserve.kv.block_manager": "05-paged-kv/block_manager.py",
    "nanoserve.kv.paged_attention": "05-paged-kv/paged_attention.py",
    "nanoserve.engine.model_runner": "06-continuous-batching/model_runner.py",
    "nanoserve.spec_decode.ngram": "14-speculative-decoding/ngram.py",
    "nanoserve.spec_decode.acceptance": "14-speculative-decoding/acceptance.py",
    "nanoserve.spec_decode.rollback": "14-speculative-decoding/rollback.py",
    "nanoserve.structured.choice": "13-structured-outputs/choice.py",
    "nanoserve.structured.bitmask": "13-structured-outputs/bitmask.py",
    "nanoserve.structured.matcher": "13-structured-outputs/matcher.py",
    "nanoserve.engine.policies.slo": "15-service-levels/slo.py",
    "nanoserve.engine.policies.fair": "15-service-levels/fair.py",
    "nanoserve.cluster.routing": "16-beyond-one-server/routing.py",
    "nanoserve.disagg.receive": "17-disaggregated-serving/receive.py",
    "nanoserve.disagg.kv_index": "17-disaggregated-serving/kv_index.py",
    "nanoserve.kv.tier_index": "18-kv-tiers/tier_index.py",
    "nanoserve.kv.load_policy": "18-kv-tiers/load_policy.py",
    "nanoserve.kv.kv_quant": "18-kv-tiers/kv_quant.py",
    "nanoserve.lora.punica": "19-multi-lora/punica.py",
    "nanoserve.lora.manager": "19-multi-lora/manager.py",
}


# files that hold a ladder of exercises: module -> {exercise: the functions (qualnames) it is}. A rung's
# functions are swapped for the reference's (with_reference) where the learner has not done that rung yet
# (serving), or is being graded on another rung (grading).
RUNGS: dict[str, dict[str, list[str]]] = {
    "nanoserve.model.attention": {
        "1.1": ["causal_mask"],
        "1.2": ["split_heads", "merge_heads", "repeat_kv"],
        "1.3": ["scaled_dot_product_attention"],
    },
    # one rung, listed so that a stubbed block.py still builds its norms from a finished 2.1 (see _load)
    "nanoserve.model.block": {
        "2.2": ["DecoderBlock.forward"],
    },
    "nanoserve.memory": {
        "4.2": ["kv_bytes_per_token", "kv_bytes_per_sequence"],
        "4.3": ["memory_plan"],
    },
    "nanoserve.kv.block_manager": {
        "5.3": ["slot_mapping"],
        "5.4": ["BlockManager.allocate_slots", "BlockManager._register_full_blocks"],
    },
    "nanoserve.kv.paged_attention": {
        "5.3": ["AttentionMetadata.build"],
        "5.5": ["gather_kv", "attend_sequence", "PagedAttention.__init__", "PagedAttention.__call__"],
        "5.6": ["DecodeGroup.__init__", "DecodeGroup.attend"],
    },
    "nanoserve.model.quant": {
        "10.1": ["quantize_int8", "dequantize_int8"],
        "10.2": ["unpack_q4_1"],
        "10.3": ["int4_scale_and_zero", "dequantize_q4"],
    },
    "nanoserve.distributed.linear": {
        "11.2": ["ColumnParallelLinear.__init__", "ColumnParallelLinear.weight_loader", "ColumnParallelLinear.forward"],
        "11.3": ["RowParallelLinear.__init__", "RowParallelLinear.weight_loader", "RowParallelLinear.forward"],
    },
    "nanoserve.engine.scheduler": {
        "6.1": ["Scheduler.schedule_waiting"],
        "6.2": ["Scheduler.num_new_tokens"],
        "6.3": ["Scheduler.schedule_running", "Scheduler.preempt", "Scheduler.check_fits_alone"],
        "6.4": ["Scheduler.num_cached_tokens"],
    },
    # @triton.jit functions: the kernel takes STEP and KV_TILE as arguments, so each rung swaps alone
    "nanoserve.kernels.triton_paged_attention": {
        "7.1": ["online_softmax_step"],
        "7.3": ["load_kv_tile"],
        "7.4": ["paged_attention_kernel"],
    },
    "nanoserve.metrics": {
        "9.1": ["ttft", "itl", "e2e", "tpot", "request_latencies"],
        "9.2": ["percentile", "stats"],
        "9.3": ["meets_slos", "summarize"],
    },
    "nanoserve.bench.load": {
        "9.4": ["arrival_times"],
        "9.5": ["open_loop"],
    },
    "nanoserve.engine.snapshot": {
        "12.1": ["block_owners"],
        "12.2": ["step_kind"],
    },
    "nanoserve.engine.event_feed": {
        "12.3": ["Subscription.put", "Subscription.take"],
        "12.4": ["EventFeed.emit_if_due"],
    },
    "nanoserve.spec_decode.acceptance": {
        "14.2": ["greedy_accept"],
        "14.3": ["residual", "rejection_sample"],
    },
    "nanoserve.engine.policies.slo": {
        "15.1": ["next_token_deadline"],
        "15.2": ["SLOPolicy.laxity"],
        "15.3": ["SLOPolicy.choose_victim"],
        "15.4": ["SLOPolicy.reject_reason"],
    },
    "nanoserve.engine.policies.fair": {
        "15.5": ["fair_order"],
        "15.6": ["FairPolicy.catch_up", "FairPolicy.on_scheduled"],
    },
    "nanoserve.cluster.routing": {
        "16.1": ["power_of_two_choices"],
        "16.2": ["HashRing.__init__", "HashRing.add", "HashRing.remove", "HashRing.lookup"],
        "16.3": ["prefix_affinity"],
    },
    "nanoserve.disagg.kv_index": {
        "17.2": ["KVIndex.apply", "KVIndex.longest_prefix"],
        "17.3": ["choose_replica"],
    },
    "nanoserve.lora.punica": {
        "19.1": ["sgmv"],
        "19.2": ["bgmv"],
    },
}


# chapters whose exercises a run uses only under a flag, only in a request, or only in the server around the engine:
# what --student NN's notice tells the learner to add or run
PLUG_IN = {"08": "behind the HTTP server: serve --student 08 lists it when the server starts",
           "07": "with the Triton attention backend: add --attention-backend triton (attention_backend=\"triton\" "
                  "from Python; on a CPU, with TRITON_INTERPRET=1 in the environment from the start)",
           "12": "behind the HTTP server's engine page: serve --student 12",
           "15": "under a policy that asks it: add --scheduling-policy slo or fair",
           "16": "in a fleet's router: add --replicas N",
           "17": "in a decode engine: add --kv-role decode, or --disaggregated (kv_transfer_config from Python)"}


# chapters whose exercises no engine run (batch, serve, LLM) calls, and why: the engine refuses a --student selection
# that names one (a bare --student, every chapter, is taken: its report says what ran and what never did)
NOT_IN_ENGINE = {"01": "the engine attends with chapter 05's paged attention and never calls chapter 01's code; "
                       "generate --student 01 runs it",
                 "04": "the engine keeps its K/V in chapter 05's paged blocks and never calls chapter 04's code; "
                       "generate --student 04 runs your cache, memory --student 04 your formula",
                 "09": "the engine never calls chapter 09's code (the metrics and open-loop load of a benchmark of a "
                       "server); bench serve --student 09 runs it"}

# chapters that the engine takes (serve builds its engines through LLM, and the server, a fleet's router or a decode
# engine calls their code) but that some commands never call: what the code is, and the command that runs it
OUTSIDE_THE_STEP = {
    "08": ("the HTTP server's request params, stream, async engine and limiter", "serve --student 08 runs it"),
    "12": ("the snapshot rules and event feed of the server's engine page", "serve --student 12 runs it"),
    "13": ("the masks of a request's response_format, structured_outputs or tools, which its requests do not carry",
           "serve --student 13 runs it"),
    "16": ("a fleet's routing decisions", "serve --replicas N --student 16 runs it"),
    "17": ("a decode engine's receiving plan and the KV-aware router's index and score",
           "serve --kv-role decode --student 17 (or serve --disaggregated) runs the plan, "
           "bench experiment kv-routing --student 17 the index and score"),
    "19": ("the LoRA gathers and slots, which it loads no adapter for", "serve --lora-modules NAME=PATH --student 19 "
           "runs it"),
}

# the chapters of OUTSIDE_THE_STEP that each command building an engine never calls (serve calls them all: chapter 08,
# 12 behind its server, 13 in a request, 16 with --replicas, 17 with --kv-role, 19 with --lora-modules)
NEVER_CALLED = {"batch": ("08", "12", "13", "16", "17", "19"),
                "bench offline": ("08", "12", "13", "16", "17", "19"),
                "bench mlperf": ("08", "12", "13", "16", "17", "19"),
                # its server runs the reference's request handling, but the engine's event feed (12) on every step
                "bench http": ("08", "13", "16", "17", "19"),
                "serve": ()}


def engine_refusal(selection, command: str | None = None) -> str | None:
    """Why the engine (command None: LLM, LLMEngine) or a command that builds one ("batch", "serve", "bench http")
    refuses this --student / `student=` selection, or None: it names a chapter of NOT_IN_ENGINE, or one of
    NEVER_CALLED[command].

    >>> engine_refusal("01,05")
    "the engine attends with chapter 05's paged attention and never calls chapter 01's code; generate --student 01 runs it"
    >>> engine_refusal("16", "batch")
    "batch never calls chapter 16's code (a fleet's routing decisions); serve --replicas N --student 16 runs it"
    >>> engine_refusal(True, "batch") is None and engine_refusal("05") is None and engine_refusal("16", "serve") is None
    True
    """
    if selection is True:
        return None
    chosen = parse_selection(selection)
    never = set(NEVER_CALLED[command]) if command is not None else set()
    reasons = [NOT_IN_ENGINE[ch] if ch in NOT_IN_ENGINE else
               f"{command} never calls chapter {ch}'s code ({OUTSIDE_THE_STEP[ch][0]}); {OUTSIDE_THE_STEP[ch][1]}"
               for ch in sorted(chosen & (NOT_IN_ENGINE.keys() | never))]
    return "; ".join(reasons) or None


def check_engine_selection(selection) -> None:
    """ValueError where the engine refuses `selection` (engine_refusal): LLM asks before its model loads, LLMEngine
    before it builds anything."""
    refused = engine_refusal(selection)
    if refused is not None:
        raise ValueError(f"student={selection!r}: {refused}")


def use_student() -> bool:
    return os.environ.get("NANOSERVE_IMPL", "reference") == "student"


def student_path(module: str) -> Path:
    if module not in STUDENT_FILES:
        raise KeyError(f"no exercise mirrors {module}; known: {sorted(STUDENT_FILES)}")
    return EXERCISES / STUDENT_FILES[module]


def load_student(module: str) -> ModuleType:
    """Import the learner's mirror of `module` from exercises/ (a fresh copy on every call)."""
    path = student_path(module)
    spec = importlib.util.spec_from_file_location("student_" + module.replace(".", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def implementation(module: str) -> ModuleType:
    """The module to grade: the learner's when NANOSERVE_IMPL=student, else the reference.

    For a ladder (RUNGS), a graded test of rung "6.2" (tests/conftest.py puts the test's exercise id in
    NANOSERVE_EXERCISE) gets the learner's 6.2 and the reference's other rungs: a rung is graded on its
    own, so a slip in 6.1 does not fail the tests of 6.2.
    """
    if not use_student():
        return importlib.import_module(module)
    mod = load_student(module)
    graded = os.environ.get("NANOSERVE_EXERCISE")
    if module in RUNGS and graded:
        with_reference(mod, module, [rung for rung in RUNGS[module] if rung != graded])
    return mod


def with_reference(mod: ModuleType, module: str, rungs) -> ModuleType:
    """Swap the reference's functions in for those of `rungs` ("6.1", …) in the learner's `mod`, in place.

    A method goes into the learner's class (which mirrors the reference's, attributes and all); a
    module-level function replaces the learner's name, so the learner's other functions call it. Such a
    function calls, in turn, the learner's module-level functions of the other rungs: the reference's
    scaled_dot_product_attention (1.3 not done) masks with the learner's causal_mask (1.1 done).
    """
    if not rungs:
        return mod
    reference = importlib.import_module(module)
    swapped = {qualname for rung in rungs for qualname in RUNGS[module][rung]}
    # the reference's names, but the learner's for the module-level functions of the rungs that stay theirs
    scope = {**vars(reference), **{name: getattr(mod, name) for ladder in RUNGS[module].values() for name in ladder
                                   if "." not in name and name not in swapped and hasattr(mod, name)}}
    for qualname in swapped:
        owner, ref_owner, attr = mod, reference, qualname
        if "." in qualname:
            cls, attr = qualname.split(".")
            owner, ref_owner = getattr(mod, cls), getattr(reference, cls)
        fn = inspect.getattr_static(ref_owner, attr)
        if owner is mod and inspect.isfunction(fn) and fn.__globals__ is vars(reference):
            fn = scope[attr] = _with_globals(fn, scope)
        setattr(owner, attr, fn)
    return mod


def _with_globals(fn, scope: dict):
    """`fn`'s code, looking its global names up in `scope` instead of its own module."""
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


def chapters() -> list[str]:
    """The chapters that have exercises: ["01", "02", ...]."""
    return sorted({file.split("-")[0] for file in STUDENT_FILES.values()})


def parse_selection(selection) -> frozenset[str]:
    """--student's value -> chapter numbers. True: all; False/None: none; "5,06" or ["05"]: those.

    >>> sorted(parse_selection("5,06"))
    ['05', '06']
    """
    if selection is True:
        return frozenset(chapters())
    if not selection:
        return frozenset()
    items = selection.split(",") if isinstance(selection, str) else list(selection)
    chosen = {str(item).strip().zfill(2) for item in items}
    unknown = chosen - set(chapters())
    if unknown:
        raise ValueError(f"no exercises for chapter(s) {', '.join(sorted(unknown))}; "
                         f"chapters with exercises: {', '.join(chapters())}")
    return frozenset(chosen)


def unfinished(path: Path) -> dict[str, list[str]]:
    """The stubs still left in a learner's file: {"Exercise 6.1": ["Scheduler.schedule"], ...}.

    A stub is any `raise NotImplementedError(...)` left in a function; the exercise id is read
    from its message ("Exercise 6.1: ..."), else the file's name stands in for it.
    """
    todo: dict[str, list[str]] = {}

    def visit(node, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Raise) and _raises_not_implemented(child):
                message = _first_string(child.exc)
                exercise = message.split(":")[0] if message.startswith("Exercise") else path.name
                todo.setdefault(exercise, []).append(scope or "module")
            is_scope = isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, (f"{scope}.{child.name}" if scope else child.name) if is_scope else scope)

    visit(ast.parse(path.read_text(), str(path)), "")
    return {exercise: list(dict.fromkeys(names)) for exercise, names in todo.items()}


def _raises_not_implemented(node: ast.Raise) -> bool:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _first_string(exc) -> str:
    if isinstance(exc, ast.Call) and exc.args:
        arg = exc.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            return str(arg.values[0].value)
    return ""


def defined_names(mod: ModuleType, swapped=frozenset()) -> list[str]:
    """What the learner's file itself defines: ["BlockAllocator", "hash_block", "Scheduler.schedule", ...],
    less `swapped` (the qualnames of unfinished rungs, which the reference's code stands in for)."""
    names = []
    for name, obj in vars(mod).items():
        # a @triton.jit function (chapter 07) wraps the Python function it compiles; under the interpreter the
        # wrapper's own __module__ is Triton's, so the wrapped function says whose file it is
        source = getattr(getattr(obj, "fn", None), "__module__", None) or getattr(obj, "__module__", None)
        if source != mod.__name__ or name.startswith("_"):
            continue
        if inspect.isfunction(obj) or inspect.isfunction(getattr(obj, "fn", None)):
            names.append(name)
        elif inspect.isclass(obj):
            own = [a for a, m in vars(obj).items()
                   if (inspect.isfunction(m) or isinstance(m, (staticmethod, classmethod))) and not a.startswith("_")]
            inherited = any(base.__module__ != mod.__name__ for base in obj.__mro__[1:-1])
            mixed = any(qualname.startswith(f"{name}.") for qualname in swapped)
            # a class that inherits the reference, or holds some of its functions: name what the learner wrote in it
            names += [f"{name}.{a}" for a in own] if inherited or mixed else [name]
    return [name for name in names if name not in swapped]


def count_calls(mod: ModuleType, calls: Counter) -> ModuleType:
    """Wrap every function and method the learner's file defines so each call adds 1 to calls[qualname]."""
    wrapped = {}

    def wrap(fn):
        if fn not in wrapped:
            @functools.wraps(fn)
            def counted(*args, **kwargs):
                calls[fn.__qualname__] += 1
                return fn(*args, **kwargs)
            wrapped[fn] = counted
        return wrapped[fn]

    for name, obj in list(vars(mod).items()):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            setattr(mod, name, wrap(obj))
        elif inspect.isclass(obj):
            for attr, member in list(vars(obj).items()):
                if inspect.isfunction(member):
                    setattr(obj, attr, wrap(member))
                elif isinstance(member, (staticmethod, classmethod)) and \
                        getattr(member.__func__, "__module__", None) == mod.__name__:
                    setattr(obj, attr, type(member)(wrap(member.__func__)))
    return mod


class StudentCode:
    """One run's choice of learner modules (`--student`), and the record of what they did."""

    def __init__(self, selection=False):
        self.chapters = parse_selection(selection)
        # module -> (file, the learner's names that run, the rungs that fell back) or why the reference runs
        self.used: dict[str, tuple[Path, list[str], list[str]] | str] = {}
        self.calls: Counter = Counter()  # qualname of a learner's function -> calls
        self.modules: dict[str, ModuleType] = {}  # what module() gave: asked twice, the same module

    def __bool__(self) -> bool:
        return bool(self.chapters)

    def module(self, name: str) -> ModuleType:
        """The learner's `name` if its chapter is selected and its file (or, for a ladder, a rung of it) is
        finished; else the reference."""
        if name not in self.modules:
            self.modules[name] = mod = self._load(name)
            if mod.__name__ != name:
                self._link(mod, name)
        return self.modules[name]

    def _link(self, mod: ModuleType, name: str) -> None:
        """The learner's files of one chapter call each other: a function or class that `mod` imports from
        another exercise module of its chapter (paged_attention.py's `slot_mapping`, from block_manager.py;
        block.py's `RMSNorm`, from layers.py) becomes that module's as this run serves it — the learner's
        where finished, else the reference's."""
        chapter = STUDENT_FILES[name][:2]
        for attr, obj in list(vars(mod).items()):
            source = getattr(obj, "__module__", None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and source != name \
                    and STUDENT_FILES.get(source, "")[:2] == chapter:
                setattr(mod, attr, getattr(self.module(source), obj.__name__, obj))

    def _load(self, name: str) -> ModuleType:
        if name not in STUDENT_FILES or STUDENT_FILES[name][:2] not in self.chapters:
            return importlib.import_module(name)
        path = student_path(name)
        todo = unfinished(path)
        rungs = [exercise.removeprefix("Exercise ") for exercise in todo]
        ladder = set(RUNGS.get(name, {}))
        # the reference runs for a file that is not a ladder, or has no rung done and builds on none of the learner's
        if todo and (not set(rungs) <= ladder or set(rungs) == ladder and not self._builds_on_yours(name)):
            stubs = "; ".join(f"{exercise} ({', '.join(names) if len(names) <= 3 else f'{len(names)} functions'})"
                              for exercise, names in todo.items())
            self.used[name] = f"{_short(path)} still raises NotImplementedError in {stubs}"
            warnings.warn(f"{', '.join(todo)} not finished in {_short(path)}: the reference {name} runs instead",
                          stacklevel=3)
            return importlib.import_module(name)
        mod = count_calls(load_student(name), self.calls)  # before with_reference: count only the learner's calls
        swapped = {qualname for rung in rungs for qualname in RUNGS[name][rung]}
        self.used[name] = (path, defined_names(mod, swapped), rungs)
        if rungs:
            beside = "with your other rungs" if set(rungs) != ladder else \
                "in your file, whose given code builds on your finished files of the chapter"
            warnings.warn(f"{', '.join(todo)} not finished in {_short(path)}: the reference's "
                          f"{', '.join(sorted(swapped))} runs instead, {beside}", stacklevel=3)
        return with_reference(mod, name, rungs)

    def _builds_on_yours(self, name: str) -> bool:
        """Whether the learner's file of `name` imports a class that this run serves as the learner's own from
        another exercise file of its chapter (block.py's RMSNorm, from a finished layers.py): its given code then
        builds the learner's objects."""
        chapter = STUDENT_FILES[name][:2]
        for node in ast.walk(ast.parse(student_path(name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != name \
                    and STUDENT_FILES.get(node.module, "")[:2] == chapter:
                served = self.module(node.module)
                if any(inspect.isclass(obj := getattr(served, alias.name, None)) and obj.__module__ == served.__name__
                       != node.module for alias in node.names):
                    return True
        return False

    def serves(self, module: str, rung: str) -> bool:
        """Whether this run serves the learner's `rung` ("6.1") of `module`: its chapter selected, its stubs written.
        (The engine asks before it loads anything, to refuse a mode that rung does not build.)"""
        return STUDENT_FILES.get(module, "")[:2] in self.chapters \
            and f"Exercise {rung}" not in unfinished(student_path(module))

    def describe(self, runs: str = "the engine runs", idle: bool = True) -> str:
        """Whose code runs: one line per module the run asked for (idle: and the chapters none of it is from)."""
        lines = [f"--student {','.join(sorted(self.chapters))}: {runs}"]
        for name, use in self.used.items():
            if isinstance(use, tuple):
                path, names, rungs = use
                lines.append(f"  yours      {', '.join(names) or 'no rung yet: the given code, built on your files'}"
                             f"  from {_short(path)}")
                for rung in rungs:
                    lines.append(f"  reference  {', '.join(RUNGS[name][rung])}  (Exercise {rung} not finished)")
            else:
                lines.append(f"  reference  {name}  ({use})")
        idle = sorted(self.chapters - {STUDENT_FILES[name][:2] for name in self.used}) if idle else []
        # a chapter whose code plugs in elsewhere (another backend, policy or layer) says where; the others, how to
        # grade them
        elsewhere = [ch for ch in idle if ch in PLUG_IN]
        if nowhere := [ch for ch in idle if ch not in PLUG_IN]:
            lines.append(f"  (no exercise of chapter {', '.join(nowhere)} plugs into this run: grade "
                         f"{'it' if len(nowhere) == 1 else 'them'} with "
                         f"{', '.join(f'make grade CH={ch}' for ch in nowhere)})")
        lines += [f"  (chapter {ch}'s code runs only {PLUG_IN[ch]})" for ch in elsewhere]
        return "\n".join(lines)

    def proof(self, served: str = "") -> str:
        """How often the learner's code was called in this run (then `served`, what it achieved); and, on a second
        line, what of it the run loaded but never called (chapter 01's split_heads: the model splits its own heads)."""
        if not any(isinstance(use, tuple) for use in self.used.values()):
            return "--student: none of your code ran (every exercise fell back to the reference)"
        public = [(name, n) for name, n in self.calls.most_common() if not name.split(".")[-1].startswith("_")]
        counts = ", ".join(f"{name} ×{n}" for name, n in public) or "no calls yet"
        idle = self.never_called()
        return f"--student: your code served: {counts}" + (f"; {served}" if served else "") + \
            (f"\n--student: yours, never called in this run: {', '.join(idle)}" if idle else "")

    def never_called(self) -> list[str]:
        """The learner's functions and classes, as describe() names them, that this run has not called once. A
        class counts as called when any of its methods was; what is not counted (chapter 07's @triton.jit
        kernels run inside the compiled kernel, not as Python calls) is left out."""
        idle = []
        for module, use in self.used.items():
            if not isinstance(use, tuple):
                continue
            for qualname in use[1]:
                obj = functools.reduce(getattr, qualname.split("."), self.modules[module])
                counted = inspect.isfunction(obj) or (
                    inspect.isclass(obj) and any(inspect.isfunction(m) for m in vars(obj).values()))
                if counted and not any(name == qualname or name.startswith(qualname + ".") for name in self.calls):
                    idle.append(qualname)
        return idle


def _short(path: Path) -> str:
    try:
        return str(path.relative_to(EXERCISES.parent))
    except ValueError:
        return str(path)
