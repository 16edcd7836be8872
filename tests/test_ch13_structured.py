"""Chapter 13 — structured outputs, the parts: the canonical cache key, the grammar cache and its 400s, the
three exercise rungs graded against xgrammar (13.1 a choice list's mask by hand, 13.2 applying packed bitmasks,
13.3 a matcher synced to a sequence), and the engine end to end on a random-weight model with the real
49,152-token vocabulary: every constrained output is in its grammar, unconstrained neighbours are token-identical
to their solo runs, preemption and n > 1 keep their matchers right, and a slow compilation never holds up steps."""

import asyncio
import json
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from nanoserve.engine.config import CacheConfig, EngineConfig, engine_config

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.structured import StructuredOutputsParams
from nanoserve.structured.compiler import GrammarCache, StructuredOutputError
from nanoserve.student import implementation
from tests.tiny_model import tiny_llama

VOCAB = 49152
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "role", "tags"]}


@pytest.fixture(scope="module")
def cache(smollm2_tokenizer):
    return GrammarCache(smollm2_tokenizer, VOCAB)


@pytest.fixture(scope="module")
def tiny():
    """Random weights, but SmolLM2's vocabulary size: the real tokenizer's masks fit its logits."""
    return tiny_llama(vocab_size=VOCAB)


def engine(tiny, tokenizer, **config):
    return LLMEngine(tiny, engine_config(**{"num_blocks": 256, **config}), tokenizer)


def run(eng) -> dict:
    """Step to the end: {(request_id, index): (output token ids, text, finish_reason)}."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finish_reason is not None:
                done[out.request_id, out.index] = (out.token_ids, out.text, out.finish_reason)
    return done


def allowed(matcher_or_mask) -> torch.Tensor:
    """The ids an xgrammar matcher allows next, or those of a (1, words) packed mask."""
    bitmask = matcher_or_mask
    if isinstance(matcher_or_mask, xgr.GrammarMatcher):
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        matcher_or_mask.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].nonzero().flatten()


# ---- params and the grammar cache -------------------------------------------------------------------------

def test_the_cache_key_is_canonical_keyword_order_and_spacing_do_not_matter_property_order_does():
    a = StructuredOutputsParams(json='{"type": "object",\n "properties": {"a": {"maxLength": 3, "type": "string"}, "b": {}}}')
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "string", "maxLength": 3}, "b": {}}, "type": "object"})
    swapped = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {"type": "string", "maxLength": 3}}})
    literal = StructuredOutputsParams(json={"const": {"y": 1, "x": 2}})
    assert a.key == b.key == 'json:{"properties":{"a":{"maxLength":3,"type":"string"},"b":{}},"type":"object"}'
    assert swapped.key != a.key  # the order of the properties is the order the grammar writes them
    assert literal.key == 'json:{"const":{"y":1,"x":2}}'  # a literal is written as given: never reordered
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_compiled_once_per_schema_then_cached_and_each_request_counted_once(cache):
    hits, misses = cache.hits, cache.misses
    first = cache.compile(StructuredOutputsParams(json={"type": "integer", "minimum": 3}))
    again = cache.compile(StructuredOutputsParams(json='{"minimum": 3, "type":  "integer"}'))
    assert again is first and (cache.hits, cache.misses) == (hits + 1, misses + 1)


def test_the_async_engine_hands_its_grammar_over_one_lookup_per_request(tiny, smollm2_tokenizer):
    """Through the async engine (the server's path) a request is looked up once: 1 miss, then 1 hit each."""
    from nanoserve.engine.async_engine import AsyncLLMEngine

    async_engine = AsyncLLMEngine(engine(tiny, smollm2_tokenizer))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=4, structured=StructuredOutputsParams(choice=["ab", "cd"]))

    async def main():
        for i in range(3):
            await _collect(async_engine.generate(f"r{i}", [5, 6], params))
    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    cache = async_engine.engine.structured.cache
    assert (cache.hits, cache.misses) == (2, 1)


def test_concurrent_requests_for_one_new_schema_compile_it_once(smollm2_tokenizer, monkeypatch):
    cache = GrammarCache(smollm2_tokenizer, VOCAB)
    release, calls = threading.Event(), []
    original = GrammarCache._compile

    def slow_compile(self, params):
        calls.append(params.key)
        assert release.wait(60)
        return original(self, params)

    monkeypatch.setattr(GrammarCache, "_compile", slow_compile)
    params = [StructuredOutputsParams(json={"type": "string", "maxLength": 4}) for _ in range(6)]

    async def main():
        tasks = [asyncio.ensure_future(cache.compile_async(p)) for p in params]
        await asyncio.sleep(0.2)  # all six asked while the first one's compilation is held
        tasks[0].cancel()  # a client gone: the others still get the grammar
        release.set()
        return await asyncio.gather(*tasks[1:])

    grammars = asyncio.run(main())
    assert len(calls) == 1 and all(g is grammars[0] for g in grammars)
    assert (cache.hits, cache.misses) == (5, 1)
    assert cache.compile(params[0]) is grammars[0] and cache.hits == 6


def test_the_cache_is_bounded_least_recently_used_out_first(smollm2_tokenizer):
    probe = GrammarCache(smollm2_tokenizer, VOCAB)
    schemas = [{"type": "string", "maxLength": n} for n in (1, 2, 3)]
    size = max(probe.compile(StructuredOutputsParams(json=s)).memory_size_bytes for s in schemas)
    cache = GrammarCache(smollm2_tokenizer, VOCAB, max_cache_bytes=2 * size)
    first, second, third = (StructuredOutputsParams(json=s) for s in schemas)
    cache.compile(first), cache.compile(second)
    cache.compile(first)  # used again: `second` is now the least recently used
    cache.compile(third)
    assert list(cache.grammars) == [first.key, third.key] and cache.cache_bytes <= 2 * size
    cache.compile(second)  # evicted, so compiled again
    assert (cache.hits, cache.misses) == (1, 4)


@pytest.mark.parametrize("params, reason", [
    (StructuredOutputsParams(json={"type": "strin"}), 'Unsupported type "strin"'),
    (StructuredOutputsParams(regex="(ab"), "parenthesis is not closed"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(?<=a)b"}), "Lookbehind is not supported"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_a_grammar_xgrammar_cannot_compile_names_the_reason(cache, params, reason):
    with pytest.raises(StructuredOutputError, match="cannot be compiled") as e:
        cache.compile(params)
    assert reason in str(e.value) and "/project/cpp" not in str(e.value)


def test_a_grammar_over_the_size_limit_is_refused(smollm2_tokenizer):
    small = GrammarCache(smollm2_tokenizer, VOCAB, max_grammar_bytes=100)
    with pytest.raises(StructuredOutputError, match="over this server's limit of 100"):
        small.compile(StructuredOutputsParams(choice=[f"option number {i}" for i in range(20)]))


# ---- 13.1 a choice list's mask by hand, against xgrammar's ----------------------------------------------

def xgrammar_choice(cache, choices: list[str]) -> "xgr.CompiledGrammar":
    """The reference: xgrammar's own automaton for `root ::= "yes" | "no" | ...` over the same vocabulary."""
    ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return xgr.GrammarCompiler(cache.tokenizer_info).compile_grammar(ebnf)


@pytest.mark.exercise("13.1")
def test_choice_mask_by_hand_equals_xgrammars(cache, smollm2_tokenizer):
    choice = implementation("nanoserve.structured.choice")
    choices = ["yes", "no", "not sure", "nothing", "né"]
    vocab = [b"" if i in smollm2_tokenizer.special_ids else p for i, p in enumerate(smollm2_tokenizer.id_to_bytes)]
    trie = choice.build_trie(choices)
    matcher = xgr.GrammarMatcher(xgrammar_choice(cache, choices))
    eos = smollm2_tokenizer.eos_token_id
    for prefix in [b"", b"n", b"no", b"not", b"not s", b"n\xc3", b"yes"]:
        if prefix:
            matcher.reset()
            assert matcher.accept_string(prefix)
        mine = choice.choice_mask(trie, prefix, vocab, [eos])
        assert mine.shape == (VOCAB,) and mine.dtype == torch.bool
        assert mine.nonzero().flatten().tolist() == allowed(matcher).tolist(), prefix
    assert choice.choice_mask(trie, b"x", vocab, [eos]).sum() == 0  # off the grammar: nothing may follow


def test_a_choice_list_served_by_its_trie_samples_what_xgrammar_samples(tiny, smollm2_tokenizer):
    """The engine serves a choice list through the trie (trie_grammar.py, 13.1's functions); the same choices as an
    EBNF grammar go through xgrammar. Same masks, so the same seeded samples, token for token."""
    choices = ["red", "green", "not sure", "né"]
    ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    eng = engine(tiny, smollm2_tokenizer)
    prompt = smollm2_tokenizer.encode("Pick one:")
    for seed in range(4):
        for name, structured in [("trie", StructuredOutputsParams(choice=choices)),
                                 ("xgrammar", StructuredOutputsParams(grammar=ebnf))]:
            eng.add_request(f"{name}{seed}", prompt, SamplingParams(temperature=1.5, seed=seed, max_tokens=12,
                                                                    structured=structured))
    got = run(eng)
    for seed in range(4):
        assert got[f"trie{seed}", 0] == got[f"xgrammar{seed}", 0]
        assert got[f"trie{seed}", 0][1] in choices and got[f"trie{seed}", 0][2] == "stop"
    grammar = eng.structured.cache.compile(StructuredOutputsParams(choice=choices))
    nodes = {c.encode()[:i] for c in choices for i in range(len(c.encode()) + 1)}  # every path from the root
    assert type(grammar).__name__ == "ChoiceGrammar" and b"" in nodes and len(nodes) == 19  # b"", 3 r.., 5 g.., 8 n.., n\xc3 n\xc3\xa9
    assert set(grammar.masks) == nodes  # every node's mask computed when it compiled, none other


def test_the_choice_matcher_reads_bytes_and_refuses_what_leaves_the_trie(cache, smollm2_tokenizer):
    from nanoserve.structured.matcher import GrammarViolation
    from nanoserve.structured.trie_grammar import ChoiceMatcher, pack_bitmask

    mask = torch.rand(VOCAB) < 0.3
    assert allowed(pack_bitmask(mask).unsqueeze(0)).tolist() == mask.nonzero().flatten().tolist()
    grammar = cache.compile(StructuredOutputsParams(choice=["not", "no"]))
    tok, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_id
    n, o, t, ot, x = (tok.id_to_bytes.index(p) for p in [b"n", b"o", b"t", b"ot", b"x"])
    matcher = ChoiceMatcher(grammar)
    for spelling in ([n, o, t], [n, ot]):  # two spellings, one trie node, one mask
        matcher.sync(spelling)
        assert matcher.prefix == b"not" and not matcher.is_terminated
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    assert allowed(bitmask).tolist() == [eos] and set(grammar.masks) == {b"", b"n", b"no", b"not"}
    matcher.sync([n, o, eos])
    assert matcher.is_terminated
    special = next(i for i in tok.special_ids if i != eos)
    for bad in ([n, x], [n, eos], [n, o, eos, o], [special]):
        with pytest.raises(GrammarViolation):
            matcher.sync(bad)


# ---- 13.2 packed bitmasks on a batch of logits rows -----------------------------------------------------

@pytest.mark.exercise("13.2")
def test_unpack_bitmask_bit_order():
    bitmask = implementation("nanoserve.structured.bitmask")
    words = torch.tensor([[5, -2147483648], [-1, 0]], dtype=torch.int32)  # bit 31 set is a negative int32
    got = bitmask.unpack_bitmask(words, 40)
    assert got.shape == (2, 40) and got.dtype == torch.bool
    assert got[0].nonzero().flatten().tolist() == [0, 2]  # 40 tokens: bit 31 of word 1 (token 63) is cut
    assert got[1].nonzero().flatten().tolist() == list(range(32))
    assert bitmask.unpack_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.exercise("13.2")
def test_apply_token_bitmask_equals_xgrammars_on_the_rows_given_only():
    bitmask = implementation("nanoserve.structured.bitmask")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g)
    masks = torch.randint(-2**31, 2**31, (2, VOCAB // 32), generator=g, dtype=torch.int64).to(torch.int32)
    rows = [3, 1]
    expected = logits.clone()
    full = torch.full((5, VOCAB // 32), -1, dtype=torch.int32)
    full[rows] = masks
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    got = logits.clone()
    bitmask.apply_token_bitmask(got, masks, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])  # the other rows are bit for bit untouched
    bitmask.apply_token_bitmask(got, masks[:0], [])  # no constrained row: nothing happens
    assert torch.equal(got, expected)


# ---- 13.3 a matcher synced to the engine's sequence ----------------------------------------------------

@pytest.mark.exercise("13.3")
def test_sequence_matcher_advances_and_rolls_back_with_the_sequence(cache, smollm2_tokenizer):
    matcher_mod = implementation("nanoserve.structured.matcher")
    grammar = cache.compile(StructuredOutputsParams(json=PERSON))
    tok = smollm2_tokenizer
    text_a = '{"name": "Al", "role": "user", "tags": ["x"]}'
    ids_a, ids_b = tok.encode(text_a), tok.encode('{"name": "Bo", "role": "admin", "tags": ["yz"]}')

    def state_after(ids):  # an independent matcher fed these ids from scratch
        fresh = xgr.GrammarMatcher(grammar)
        for t in ids:
            assert fresh.accept_token(t)
        return allowed(fresh)

    def mask_of(m):
        bm = xgr.allocate_token_bitmask(2, VOCAB)
        m.fill(bm, 1)
        return allowed(bm[1:])

    m = matcher_mod.SequenceMatcher(grammar)
    for n in [0, 3, 4, 9, 5, 5, 12]:  # grows, grows by one (a decode), rolls back, stays (a recompute), grows
        m.sync(ids_a[:n])
        assert m.tokens == ids_a[:n] and torch.equal(mask_of(m), state_after(ids_a[:n])), n
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b)
    m.sync(ids_b[:common + 3])  # a different continuation: roll back to the common prefix, then accept
    assert m.tokens == ids_b[:common + 3] and torch.equal(mask_of(m), state_after(ids_b[:common + 3]))
    m.sync(ids_a + [tok.eos_token_id])
    assert m.is_terminated
    with pytest.raises(matcher_mod.GrammarViolation):
        matcher_mod.SequenceMatcher(grammar).sync(tok.encode('{"name": 1'))


# ---- the engine end to end (random weights, real vocabulary) ---------------------------------------------

def test_constrained_outputs_follow_their_grammar_and_neighbours_are_untouched(tiny, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = [tok.encode(p) for p in ["Hello there", "A person:", "Choose:", "Write a regex"]]
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, seed=7, max_tokens=12)]
    alone = engine(tiny, tok)
    for i, p in enumerate(free):
        alone.add_request(f"free{i}", prompts[i], p)
    solo = run(alone)

    mixed = engine(tiny, tok)
    for i, p in enumerate(free):
        mixed.add_request(f"free{i}", prompts[i], p)
    constrained = {
        "json": StructuredOutputsParams(json=PERSON), "choice": StructuredOutputsParams(choice=["red", "green"]),
        "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
    }
    for name, structured in constrained.items():
        for temp in [0, 1.0]:
            mixed.add_request(f"{name}{temp}", prompts[1], SamplingParams(temperature=temp, seed=1, max_tokens=40,
                                                                          structured=structured))
    got = run(mixed)
    for i in range(len(free)):
        assert got[f"free{i}", 0] == solo[f"free{i}", 0]  # the masks touched only their own rows
    for temp in [0, 1.0]:
        _, text, finish = got[f"json{temp}", 0]
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        assert got[f"choice{temp}", 0][1] in ("red", "green")
        assert __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2}", got[f"regex{temp}", 0][1])
    assert mixed.structured.matchers == {} and mixed.structured.grammars == {}  # released with their requests


def test_parallel_sampling_one_matcher_per_completion(tiny, smollm2_tokenizer):
    tok = smollm2_tokenizer
    eng = engine(tiny, tok)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "c": {"enum": ["a", "b", "c", "d"]}}, "required": ["n", "c"]}
    eng.add_request("r", tok.encode("x"), SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=30,
                                                          structured=StructuredOutputsParams(json=schema)))
    got = run(eng)
    assert sorted(got) == [("r", i) for i in range(4)]
    texts = [got["r", i][1] for i in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # four completions, each its own matcher and draws


def test_the_matcher_survives_preemption(tiny, smollm2_tokenizer):
    """A pool too small for all: sequences are preempted and recomputed, their outputs unchanged."""
    tok = smollm2_tokenizer
    structured = StructuredOutputsParams(json=PERSON)
    outputs = {}
    for num_blocks in [256, 6]:
        eng = engine(tiny, tok, num_blocks=num_blocks, block_size=4)
        for i in range(3):
            eng.add_request(f"r{i}", tok.encode(f"person {i}"), SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                                                                               structured=structured))
        preemptions = 0
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finish_reason is not None:
                    done[out.request_id] = out.token_ids
                    preemptions += out.metrics["num_preemptions"]
        outputs[num_blocks] = done, preemptions
    (big, none), (small, some) = outputs[256], outputs[6]
    assert none == 0 and some > 0
    assert small == big


def test_compilation_runs_off_the_engine_thread_and_never_stalls_steps(tiny, smollm2_tokenizer, monkeypatch):
    """A compilation that blocks (until released) while an unconstrained request runs to its end; a choice list's
    node masks (a Python walk over the vocabulary each) are all computed in the compile pool, none on the engine
    thread while it steps."""
    from nanoserve.engine.async_engine import AsyncLLMEngine

    eng = engine(tiny, smollm2_tokenizer)
    release, threads, mask_threads = threading.Event(), [], []
    original = GrammarCache._compile
    choice_mask = eng.structured.choice_module.choice_mask

    def counted_choice_mask(*args):
        mask_threads.append(threading.current_thread().name)
        return choice_mask(*args)

    monkeypatch.setattr(eng.structured.choice_module, "choice_mask", counted_choice_mask)

    def slow_compile(self, params):
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return original(self, params)

    monkeypatch.setattr(GrammarCache, "_compile", slow_compile)
    async_engine = AsyncLLMEngine(eng)
    async_engine.start()

    async def main():
        structured = SamplingParams(temperature=0, max_tokens=8,
                                    structured=StructuredOutputsParams(choice=["slow", "schema"]))
        slow = asyncio.ensure_future(_collect(async_engine.generate("slow", [5, 6], structured)))
        free = await _collect(async_engine.generate("free", [7, 8], SamplingParams(temperature=0, max_tokens=8)))
        assert not slow.done() and len(free.token_ids) == 8  # finished while the grammar was still compiling
        release.set()
        return await slow

    try:
        out = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert out.text in ("slow", "schema")
    assert threads and all(name.startswith("nanoserve-grammar") for name in threads)
    assert len(mask_threads) == 10  # one walk per trie node: b"", s, sl, slo, slow, sc, sch, sche, schem, schema
    assert all(name.startswith("nanoserve-grammar") for name in mask_threads)


async def _collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_refusals_at_the_engines_door(tiny, smollm2_tokenizer):
    eng = engine(tiny, smollm2_tokenizer)
    with pytest.raises(StructuredOutputError, match="ignore_eos"):
        eng.add_request("a", [1, 2], SamplingParams(ignore_eos=True, structured=StructuredOutputsParams(regex="a+")))
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        eng.add_request("b", [1, 2], SamplingParams(structured=StructuredOutputsParams(regex="(")))
    assert not eng.has_unfinished_requests() and eng.structured.grammars == {}
    for field, value in [("stop", ["}"]), ("stop_token_ids", [2])]:  # either would end the output before its grammar
        with pytest.raises(ValueError, match=f"^{field} cannot be combined with structured outputs"):
            SamplingParams(structured=StructuredOutputsParams(json_object=True), **{field: value})
    no_tokenizer = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16)))
    with pytest.raises(StructuredOutputError, match="need an engine with a tokenizer"):
        no_tokenizer.add_request("c", [1, 2], SamplingParams(structured=StructuredOutputsParams(regex="a")))


# ---- what the step does when a grammar and speculation meet, or a grammar is broken ------------------------

def test_constrained_requests_never_speculate_though_the_proposer_has_drafts(tiny, smollm2_tokenizer):
    """A constrained request whose output repeats its prompt (so prompt lookup always has a draft) is scheduled
    one token per decode step, while a plain request beside it, same prompt, is verified with drafts."""
    eng = engine(tiny, smollm2_tokenizer, speculative="ngram", num_speculative_tokens=3,
                 speculative_disable_by_batch_size=None)
    prompt = smollm2_tokenizer.encode("ab ab ab ab ab ab ab ab")
    choice = StructuredOutputsParams(choice=["ab ab ab ab ab ab"])
    eng.add_request("c", prompt, SamplingParams(temperature=0, max_tokens=12, structured=choice))
    eng.add_request("p", prompt + prompt, SamplingParams(temperature=0, max_tokens=12))
    drafts_refused, verified_plain = 0, 0
    while eng.has_unfinished_requests():
        c = eng.scheduler.seqs.get("c")
        if c is not None and c.num_output_tokens and eng.proposer.propose(c.token_ids, 3):
            drafts_refused += 1
        for out in eng.step():
            if out.request_id == "c" and out.finished:
                text = out.text
        plan = eng.last_scheduler_output
        for seq in plan.scheduled_seqs:
            if seq.request_id == "c" and seq.num_output_tokens > 1:
                assert plan.num_scheduled_tokens["c"] == 1  # a decode: never 1 + k
            if seq.request_id == "p" and plan.num_scheduled_tokens["p"] > 1 and seq.num_output_tokens > 1:
                verified_plain += 1
    assert drafts_refused > 0 and text == "ab ab ab ab ab ab"
    assert verified_plain > 0 and eng.spec_stats.num_drafts > 0


def test_a_verification_counts_as_sampling():
    """SchedulerOutput.samples: a sequence computing its last token and 3 drafts samples (4 positions)."""
    from nanoserve.engine.scheduler_output import SchedulerOutput
    from nanoserve.engine.sequence import Sequence

    seq = Sequence("v", [1, 2, 3], 8)
    seq.append_token(4, 0.0)
    seq.num_computed_tokens = 3  # the last token (4) and 3 drafts are this step's 4 tokens
    assert SchedulerOutput([seq], {"v": 4}).samples(seq) and SchedulerOutput([seq], {"v": 1}).samples(seq)
    seq.num_computed_tokens = 0
    assert not SchedulerOutput([seq], {"v": 2}).samples(seq)  # a partial prefill chunk


def test_a_grammar_violation_fails_that_request_alone(tiny, smollm2_tokenizer, monkeypatch):
    """A bitmask that masks nothing (a broken exercise 13.2) lets the random model leave its grammar: that request's
    stream raises with the reason, the unconstrained request in the same steps gets its solo tokens, no block is
    left behind, and the engine serves on."""
    import types

    from nanoserve.engine.async_engine import AsyncLLMEngine, EngineStepError

    solo = engine(tiny, smollm2_tokenizer)
    solo.add_request("free", [7, 8, 9], SamplingParams(temperature=0, max_tokens=10))
    alone = run(solo)["free", 0][0]

    eng = engine(tiny, smollm2_tokenizer)
    free_blocks = eng.block_manager.get_num_free_blocks()
    monkeypatch.setattr(eng.structured, "bitmask_module", types.SimpleNamespace(apply_token_bitmask=lambda *a: None))
    async_engine = AsyncLLMEngine(eng)
    async_engine.start()
    strict = SamplingParams(temperature=0, max_tokens=10, structured=StructuredOutputsParams(regex="[0-9]{6}"))

    async def main():
        bad = asyncio.ensure_future(_collect(async_engine.generate("bad", [7, 8, 9], strict)))
        free = await _collect(async_engine.generate("free", [7, 8, 9], SamplingParams(temperature=0, max_tokens=10)))
        with pytest.raises(EngineStepError, match="'bad' failed in an engine step: the output left its grammar: token"):
            await bad
        again = await _collect(async_engine.generate("again", [7, 8, 9], SamplingParams(temperature=0, max_tokens=10)))
        return free, again

    try:
        free, again = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert free.token_ids == again.token_ids == alone
    assert eng.block_manager.get_num_free_blocks() == free_blocks and eng.structured.grammars == {}


def test_a_violation_in_the_last_token_fails_the_request_too(tiny, smollm2_tokenizer, monkeypatch):
    """max_tokens 1 with a mask that masks nothing: the one token is sampled after the only sync and the
    sequence finishes at once, so no later step's sync would see it; the final sync at release does: the request
    ends with the reason in `error`, and its matcher and grammar are gone."""
    import types

    eng = engine(tiny, smollm2_tokenizer)
    monkeypatch.setattr(eng.structured, "bitmask_module", types.SimpleNamespace(apply_token_bitmask=lambda *a: None))
    eng.add_request("bad", [7, 8, 9], SamplingParams(temperature=0, max_tokens=1,
                                                     structured=StructuredOutputsParams(regex="[0-9]{6}")))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    (token,) = outs[-1].token_ids
    assert not smollm2_tokenizer.decode([token]).isdigit()  # the random model left the grammar at its first token
    assert outs[-1].finish_reason is not None and "left its grammar" in (outs[-1].error or ""), outs[-1]
    assert eng.structured.matchers == {} and eng.structured.grammars == {}


def test_mask_times_count_the_constrained_steps_and_only_those(tiny, smollm2_tokenizer):
    """`bench structured` splits the overhead with MaskTimes: one step counted per step that sampled a
    constrained token, each part timed; a run without grammars counts nothing; take_times starts afresh."""
    eng = engine(tiny, smollm2_tokenizer)
    eng.add_request("free", smollm2_tokenizer.encode("x"), SamplingParams(temperature=0, max_tokens=5))
    run(eng)
    assert eng.structured.take_times() == type(eng.structured.times)()  # all zero
    eng.add_request("c", smollm2_tokenizer.encode("x"), SamplingParams(
        temperature=0, max_tokens=30, structured=StructuredOutputsParams(choice=["red", "green"])))
    ((tokens, _, _),) = run(eng).values()
    times = eng.structured.take_times()
    assert times.steps == len(tokens)  # one mask per sampled token, EOS's step included
    assert times.advance > 0 and times.fill > 0 and times.apply > 0
    assert eng.structured.times.steps == 0


def test_a_grammar_violation_is_a_500_naming_it_and_the_server_serves_on(tiny, smollm2_tokenizer, monkeypatch):
    """Through the server, the same broken mask: not the client's fault, so a 500 whose message says the output
    left its grammar (OpenAI's error body), and the next request is answered."""
    import types

    import httpx

    from nanoserve.server.runner import serving

    eng = engine(tiny, smollm2_tokenizer)
    monkeypatch.setattr(eng.structured, "bitmask_module", types.SimpleNamespace(apply_token_bitmask=lambda *a: None))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [7, 8, 9], "max_tokens": 10, "temperature": 0}
    with serving(eng, smollm2_tokenizer) as (url, _):
        bad = httpx.post(f"{url}/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]{6}"}}, timeout=60)
        good = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert bad.status_code == 500 and "left its grammar" in bad.json()["error"]["message"], bad.text
    assert good.status_code == 200 and len(good.json()["choices"][0]["text"]) > 0
