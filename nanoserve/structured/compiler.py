"""Chapter 13 — grammars compiled once per distinct request grammar, off the engine thread.

Compiling turns a schema into a pushdown automaton over bytes *and* precomputes, for each of its states,
which of the 49,152 tokens can be decided without looking at the stack (the context-independent ones,
xgrammar's "adaptive token mask cache"). That is the expensive part — milliseconds for a small schema,
seconds for a large one — and it depends on the schema alone, so it is done once and cached:

    cache: params.key ('json:{"properties":...,"type":"object"}') -> CompiledGrammar   (hits: µs, misses: ms..s)

(A choice list is the exception: its trie is its automaton, built by hand in trie_grammar.py, cached the same way.)

Three rules keep the cache honest:
- one compilation per key: requests that ask for a schema while it compiles wait for that compilation (a
  Future per key in flight) instead of starting their own;
- bounded: at most `max_cache_bytes` of compiled grammars (xgrammar's `memory_size_bytes`), least recently
  used evicted first — a client sending a new schema per request cannot grow the server without end;
- counted per request: `hits` (found compiled, or joined a compilation in flight: the request compiled
  nothing) + `misses` (it compiled) = the requests that asked.

Where it runs: `compile_async` hands a miss to a small thread pool, so the server's event loop and the engine's
thread keep going while a slow schema compiles (xgrammar's C++ releases the GIL while it works); the async
engine hands the CompiledGrammar to the engine with the request. A grammar xgrammar cannot build, or one over
`max_grammar_bytes` of text, is a StructuredOutputError (a ValueError: the server answers 400 with the reason).
"""

import asyncio
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from types import ModuleType

import xgrammar as xgr

import nanoserve.structured.choice as reference_choice
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.structured.tokenizer_info import build_tokenizer_info, vocab_bytes
from nanoserve.structured.trie_grammar import ChoiceGrammar

MAX_GRAMMAR_BYTES = 32 * 1024  # the canonical text of a schema / regex / grammar; vLLM has no such bound
MAX_CACHE_BYTES = 256 << 20  # compiled grammars kept (the chapter's schemas: ~0.1-2 MB each)


class StructuredOutputError(ValueError):
    """A request's grammar cannot be served: it does not compile, or it is too large."""


def _reason(error: Exception) -> str:
    """xgrammar's message without its '[20:58:26] /project/cpp/json_schema_converter.cc:5082: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


class GrammarCache:
    """CompiledGrammars for one vocabulary, keyed by the request grammar's canonical text (an LRU)."""

    def __init__(self, tokenizer, vocab_size: int, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 threads: int = 2, max_cache_bytes: int = MAX_CACHE_BYTES, choice_module: ModuleType = reference_choice):
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size)
        # a choice list compiles to its trie (trie_grammar.py), with the learner's choice.py under --student 13
        self.vocab, self.stop_token_ids = vocab_bytes(tokenizer, vocab_size), [tokenizer.eos_token_id]
        self.choice_module = choice_module
        # xgrammar's own cache is off: ours is the one keyed by the canonical text, and it counts hits
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self.max_grammar_bytes, self.max_cache_bytes = max_grammar_bytes, max_cache_bytes
        self.grammars: OrderedDict[str, xgr.CompiledGrammar | ChoiceGrammar] = OrderedDict()  # least recently used first
        self.cache_bytes = 0
        self.hits = self.misses = 0
        self._in_flight: dict[str, Future] = {}  # key -> the one compilation running for it
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="nanoserve-grammar")

    def compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar | ChoiceGrammar":
        """The request's CompiledGrammar: from the cache, from a compilation in flight, or compiled now (in the
        calling thread). Raises StructuredOutputError."""
        found, future, mine = self._lookup(params)
        if found is not None:
            return found
        if mine:
            self._build(params, future)
        return future.result()

    async def compile_async(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar | ChoiceGrammar":
        """`compile`, with a miss compiled in the pool's thread: the caller's event loop (and the engine thread)
        are not held up, and a request joining a compilation in flight holds no thread while it waits."""
        found, future, mine = self._lookup(params)
        if found is not None:
            return found
        if mine:
            self._pool.submit(self._build, params, future)
        return await asyncio.wrap_future(future)

    def _lookup(self, params: StructuredOutputsParams):
        """(grammar, None, False) on a hit; else (None, the key's Future, whether this caller compiles it)."""
        size = len(params.text.encode())  # never cached either: checked first
        if size > self.max_grammar_bytes:
            raise StructuredOutputError(f"the {params.kind} grammar is {size} bytes, over this server's limit of "
                                        f"{self.max_grammar_bytes}")
        with self._lock:
            grammar = self.grammars.get(params.key)
            if grammar is not None:
                self.grammars.move_to_end(params.key)
                self.hits += 1
                return grammar, None, False
            future = self._in_flight.get(params.key)
            if future is not None:
                self.hits += 1  # it compiles nothing: it waits for the compilation already running
                return None, future, False
            future = self._in_flight[params.key] = Future()
            future.set_running_or_notify_cancel()  # running: a waiter's cancellation cannot cancel it for all
            self.misses += 1
            return None, future, True

    def _build(self, params: StructuredOutputsParams, future: Future) -> None:
        """Compile, cache (evicting the least recently used past max_cache_bytes), settle the Future."""
        try:
            grammar = self._compile(params)
        except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError for every kind of bad grammar
            with self._lock:
                del self._in_flight[params.key]
            future.set_exception(StructuredOutputError(f"the {params.kind} grammar cannot be compiled: {_reason(e)}"))
            return
        with self._lock:
            self.grammars[params.key] = grammar
            self.cache_bytes += grammar.memory_size_bytes
            while self.cache_bytes > self.max_cache_bytes and len(self.grammars) > 1:
                _, evicted = self.grammars.popitem(last=False)
                self.cache_bytes -= evicted.memory_size_bytes
            del self._in_flight[params.key]
        future.set_result(grammar)

    def _compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar | ChoiceGrammar":
        kind, text = params.kind, params.text
        if kind == "json":
            # compact JSON: a free-whitespace grammar lets a small model loop on spaces and newlines
            return self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":  # no pushdown automaton needed: the choices' trie is one
            return ChoiceGrammar(list(params.choice), self.vocab, self.stop_token_ids, self.choice_module)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(text)
        return self.compiler.compile_grammar(text)
