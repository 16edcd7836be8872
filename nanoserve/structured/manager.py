"""Chapter 13 — the engine's side of structured outputs: grammars per request, matchers per completion,
and one step's bitmask (vLLM's StructuredOutputManager, in small).

    add_request            compile (or take the grammar the async engine compiled ahead, off this thread)
    before each forward    for every constrained sequence that samples this step:
                             sync its matcher to seq.output_token_ids, fill its row of the bitmask
    ModelRunner.sample     GrammarBitmask.apply: -inf on the disallowed tokens of those rows only
    a sequence finishes    sync its matcher to the final tokens (the last one is checked nowhere else), release it

The engine thread fills the masks (xgrammar: tens of microseconds a row) while the scheduler never sees
them: the bitmask rides in SchedulerOutput to the model runner like the block tables do.

A sequence whose tokens its grammar refuses (GrammarViolation: only possible if something bypassed the
mask, e.g. a learner's bitmask that masks nothing) gets no row; the engine fails that one request with the
reason (`take_failures`) and every other request of the step goes on.

Constrained requests never speculate (LLMEngine._propose): one mask per sequence and step is one sampled
position; a verification samples 1 + k positions and would need a mask for each, the matcher advanced
through the draft tokens to fill them and rolled back after. That is not built.
"""

import time
from dataclasses import dataclass
from types import ModuleType

import torch

import nanoserve.structured.bitmask as reference_bitmask
import nanoserve.structured.choice as reference_choice
import nanoserve.structured.matcher as reference_matcher
from nanoserve.structured.compiler import MAX_GRAMMAR_BYTES, GrammarCache, StructuredOutputError
from nanoserve.structured.trie_grammar import ChoiceGrammar, ChoiceMatcher


@dataclass
class MaskTimes:
    """Where a constrained step's extra time goes (`bench structured` splits the overhead with it): seconds spent
    advancing matchers over the new tokens, filling mask rows, and applying them to the logits (in the model
    runner: counted here when it runs in this process, the single-process executor's case)."""

    steps: int = 0
    advance: float = 0.0
    fill: float = 0.0
    apply: float = 0.0


@dataclass
class GrammarBitmask:
    """One step's masks: bitmask[rows[seq_id]] is the mask of that sequence's next token."""

    bitmask: torch.Tensor  # (num_constrained, ceil(vocab / 32)) int32
    rows: dict[str, int]  # seq_id -> its row in `bitmask`
    bitmask_module: ModuleType = reference_bitmask  # the learner's exercises/13 bitmask.py under --student 13
    times: MaskTimes | None = None  # the manager's, to add the apply time to

    def apply(self, seqs, logits: torch.Tensor) -> None:
        """In place on logits (len(seqs), vocab): row i of seqs[i] masked if it is constrained, else untouched."""
        t0 = time.perf_counter()
        rows = [i for i, seq in enumerate(seqs) if seq.seq_id in self.rows]
        if rows:
            picked = self.bitmask[[self.rows[seqs[i].seq_id] for i in rows]]
            self.bitmask_module.apply_token_bitmask(logits, picked, rows)
        if self.times is not None:
            self.times.apply += time.perf_counter() - t0


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 matcher_module: ModuleType = reference_matcher, bitmask_module: ModuleType = reference_bitmask,
                 choice_module: ModuleType = reference_choice):
        self.tokenizer, self.vocab_size, self.max_grammar_bytes = tokenizer, vocab_size, max_grammar_bytes
        self.matcher_module, self.bitmask_module, self.choice_module = matcher_module, bitmask_module, choice_module
        self._cache: GrammarCache | None = None  # built on the first structured request (xgrammar's setup: ~50 ms)
        self.grammars: dict[str, object] = {}  # request_id -> CompiledGrammar
        self.matchers: dict[str, object] = {}  # seq_id -> SequenceMatcher
        self.failures: dict[str, str] = {}  # request_id -> why its grammar refused its tokens (this step)
        self.times = MaskTimes()  # since the last take_times()

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if self.tokenizer is None:
                raise StructuredOutputError("structured outputs need an engine with a tokenizer (the grammar "
                                            "speaks text, the mask needs every token's bytes)")
            self._cache = GrammarCache(self.tokenizer, self.vocab_size, self.max_grammar_bytes,
                                       choice_module=self.choice_module)
        return self._cache

    def prepare(self, params, grammar=None):
        """The CompiledGrammar of a request's SamplingParams (checked): `grammar` if the caller compiled it
        ahead (the async engine: a cache lookup already counted), else from the cache. Raises
        StructuredOutputError."""
        if params.ignore_eos:
            raise StructuredOutputError("ignore_eos cannot be combined with structured outputs: the grammar "
                                        "ends the output with EOS")
        return grammar if grammar is not None else self.cache.compile(params.structured)

    def add_request(self, request_id: str, grammar) -> None:
        """The request entered the engine: its completions will be matched against `grammar`."""
        self.grammars[request_id] = grammar

    def grammar_bitmask(self, scheduler_output) -> GrammarBitmask | None:
        """The masks of this step's constrained sequences that sample (None if there are none)."""
        seqs = [s for s in scheduler_output.scheduled_seqs
                if s.request_id in self.grammars and scheduler_output.samples(s)]
        if not seqs:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        rows = {}
        for seq in seqs:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:  # a new completion (n > 1: each its own, all fresh at the prompt's first token)
                matcher = self.matchers[seq.seq_id] = self._matcher(self.grammars[seq.request_id])
            t0 = time.perf_counter()
            try:
                matcher.sync(seq.output_token_ids)
            except reference_matcher.GrammarViolation as e:  # this request fails (take_failures), the step goes on without its row
                self.failures[seq.request_id] = f"the output left its grammar: {e}"
                continue
            finally:
                t1 = time.perf_counter()
                self.times.advance += t1 - t0
            rows[seq.seq_id] = len(rows)
            matcher.fill(bitmask, rows[seq.seq_id])
            self.times.fill += time.perf_counter() - t1
        self.times.steps += 1
        return GrammarBitmask(bitmask[:len(rows)], rows, self.bitmask_module, self.times) if rows else None

    def _matcher(self, grammar):
        """A choice list's trie is followed by a ChoiceMatcher, every xgrammar grammar by a SequenceMatcher."""
        if isinstance(grammar, ChoiceGrammar):
            return ChoiceMatcher(grammar)
        return self.matcher_module.SequenceMatcher(grammar)

    def take_times(self) -> MaskTimes:
        """The mask times since the last call (bench structured takes one round's), counting afresh from here."""
        times, self.times = self.times, MaskTimes()
        return times

    def take_failures(self) -> dict[str, str]:
        """{request_id: reason} of the requests whose grammar refused their tokens since the last call."""
        failures, self.failures = self.failures, {}
        return failures

    def release(self, seq_id: str, request_id: str, request_done: bool, output_token_ids: list[int] | None = None) -> None:
        """A completion finished: drop its matcher; the request's grammar goes with its last completion.

        output_token_ids: its final tokens when it finished by sampling (not by an abort). Its last token was
        sampled after the last sync, and no later step will check it: the matcher (a fresh one if it never had
        one: a fork finishing at its first token) is synced to them here, and a refusal fails the request
        (take_failures) like a refusal at a step's sync does."""
        matcher = self.matchers.pop(seq_id, None)
        grammar = self.grammars.get(request_id)
        if output_token_ids is not None and grammar is not None:
            try:
                (matcher or self._matcher(grammar)).sync(output_token_ids)
            except reference_matcher.GrammarViolation as e:
                self.failures[request_id] = f"the output left its grammar: {e}"
        if request_done:
            self.grammars.pop(request_id, None)
