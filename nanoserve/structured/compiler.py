"""Chapter 13 — grammars compiled once per distinct request grammar, off the engine thread.

Compiling turns a schema into a pushdown automaton over bytes *and* precomputes, for each of its states,
which of the 49,152 tokens can be decided without looking at the stack (the context-independent ones,
xgrammar's "adaptive token mask cache"). That is the expensive part — milliseconds for a small schema,
seconds for a large one — and it depends on the schema alone, so it is done once and cached:

    cache: params.key ('json:{"type":"object",...}') -> CompiledGrammar      (hits: 0.1 ms, misses: ms..s)

Where it runs: `compile_async` hands it to a small thread pool, so the server's event loop and the engine's
thread keep going while a slow schema compiles (xgrammar's C++ releases the GIL while it works); the
request enters the engine only once its grammar is in the cache, and the engine's own `compile` is then a
dictionary hit. A grammar xgrammar cannot build, or one over `max_grammar_bytes` of text, is a
StructuredOutputError (a ValueError: the server answers 400 with the reason).
"""

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import xgrammar as xgr

from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.structured.tokenizer_info import build_tokenizer_info

MAX_GRAMMAR_BYTES = 32 * 1024  # the canonical text of a schema / regex / grammar; vLLM has no such bound


class StructuredOutputError(ValueError):
    """A request's grammar cannot be served: it does not compile, or it is too large."""


def _reason(error: Exception) -> str:
    """xgrammar's message without its '[20:58:26] /project/cpp/json_schema_converter.cc:5082: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


class GrammarCache:
    """CompiledGrammars for one vocabulary, keyed by the request grammar's canonical text."""

    def __init__(self, tokenizer, vocab_size: int, max_grammar_bytes: int = MAX_GRAMMAR_BYTES, threads: int = 2):
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size)
        # xgrammar's own cache is off: ours is the one keyed by the canonical text, and it counts hits
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self.max_grammar_bytes = max_grammar_bytes
        self.grammars: dict[str, xgr.CompiledGrammar] = {}
        self.compile_seconds: dict[str, float] = {}  # key -> its one cold compilation
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="nanoserve-grammar")

    def compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        """The request's CompiledGrammar: from the cache, or compiled now (in the calling thread)."""
        with self._lock:
            grammar = self.grammars.get(params.key)
            if grammar is not None:
                self.hits += 1
                return grammar
        size = len(params.text.encode())
        if size > self.max_grammar_bytes:
            raise StructuredOutputError(f"the {params.kind} grammar is {size} bytes, over this server's limit of "
                                        f"{self.max_grammar_bytes}")
        t0 = time.perf_counter()
        try:
            grammar = self._compile(params)
        except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError for every kind of bad grammar
            raise StructuredOutputError(f"the {params.kind} grammar cannot be compiled: {_reason(e)}") from None
        with self._lock:
            self.misses += 1
            self.compile_seconds.setdefault(params.key, time.perf_counter() - t0)
            return self.grammars.setdefault(params.key, grammar)  # two racing compilations: the first one wins

    async def compile_async(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        """`compile` in the pool's thread: the caller's event loop (and the engine thread) are not held up."""
        with self._lock:
            if params.key in self.grammars:
                return self.grammars[params.key]
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.compile, params)

    def _compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        kind, text = params.kind, params.text
        if kind == "json":
            # compact JSON: a free-whitespace grammar lets a small model loop on spaces and newlines
            return self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":  # root ::= "yes" | "no" — a JSON string literal is an EBNF string literal
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
        return self.compiler.compile_grammar(text)
