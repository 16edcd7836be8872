"""Chapter 13's worked examples, computed by the code: the tokens the chapter names (the tokenizer), the canonical
key of a schema (params.py), a packed mask row's size, the compiler's and the trie's bounds, a schema xgrammar
refuses and a tool call's id are built here from nanoserve/ and must appear in the chapter word for word. (The
notebook's and the benchmark's timings are quoted by no figure: the chapter says so.)"""

import re

import pytest

from nanoserve.server.tool_calls import message
from nanoserve.structured import compiler, trie_grammar
from nanoserve.structured.compiler import GrammarCache, StructuredOutputError
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.structured.tools import Tool, plan
from tests.chapter_text import chapter, says

CH = "13"


def test_a_token_is_not_a_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    (brace_quote,) = tok.encode('{"')
    says(CH, f"`{{\"` is one token (id {brace_quote})")
    for text in ('":"', " Smith", "not", "no", "t", "n", "ot"):
        assert len(tok.encode(text)) == 1, text  # each one token of the vocabulary
    says(CH, "`not`\nmay come as `[not]`, `[no][t]` or `[n][ot]`")
    says(CH, f"**which of the {tok.vocab_size:,} tokens may come next?**")


def test_a_packed_mask_row(smollm2_tokenizer):
    words = -(-smollm2_tokenizer.vocab_size // 32)
    says(CH, f"A mask is packed: 32 tokens to an int32 word, {words:,} words ({words * 4 // 1024} KiB) a row")


def test_the_canonical_key():
    a = StructuredOutputsParams(json={"type": "string", "maxLength": 12})
    b = StructuredOutputsParams(json={"maxLength": 12, "type": "string"})
    assert a.key == b.key  # keywords sorted: one cache entry
    names = StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "string"}, "a": {}}})
    assert names.key == 'json:{"properties":{"b":{"type":"string"},"a":{}},"type":"object"}'  # names keep their order
    says(CH, '(`json:{"properties":{...},"type":"object"}`: keywords sorted, so `{"type": ..., "maxLength": ...}` and\n'
             '`{"maxLength": ..., "type": ...}` are one entry')


def test_the_bounds():
    says(CH, f"and so is one over {compiler.MAX_GRAMMAR_BYTES // 1024} KiB of text, a choice list whose trie has more "
             f"than {trie_grammar.MAX_CHOICE_NODES} nodes")
    says(CH, f"may have at most {trie_grammar.MAX_CHOICE_NODES} trie nodes")
    says(CH, f"at most {compiler.MAX_CACHE_BYTES >> 20} MiB of compiled grammars")


def test_a_schema_xgrammar_cannot_compile(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    with pytest.raises(StructuredOutputError) as refused:
        cache.compile(StructuredOutputsParams(json={"type": "strin"}))
    message = str(refused.value)
    assert message.startswith("the json grammar cannot be compiled: ")
    says(CH, f"(`{message}`)")


def test_a_tool_calls_id():
    weather = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    reply, finish_reason = message(plan([weather], "required"), '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                                   "stop")
    (call,) = reply["tool_calls"]
    assert finish_reason == "tool_calls" and reply["content"] is None and call["function"]["arguments"] == '{"city": "Paris"}'
    digits = call["id"].removeprefix("call_")
    assert call["id"].startswith("call_") and re.fullmatch("[0-9a-f]+", digits)
    says(CH, f"each with an `id` (`call_` and {len(digits)} hex digits)")


def test_the_measured_overhead_and_its_reading():
    """The Measured block's split adds up to its overhead, and the reading below it is computed from the block."""
    text = chapter(CH)
    split = {int(n): [float(x) for x in parts] for n, *parts in re.findall(
        r"TPOT overhead at (\d+): \+[\d.]+ % = ([\d.]+) ms a step: matcher advance ([\d.]+) ms, mask fill ([\d.]+) ms, "
        r"mask apply ([\d.]+) ms, the rest ([\d.]+) ms", text)}
    assert set(split) == {1, 16}
    for total, *parts in split.values():
        assert abs(sum(parts) - total) < 0.015  # the rest is the difference less the three timed parts
    total, advance, fill, apply, rest = split[16]
    says(CH, f"*mask apply* is {apply} of the {total} ms ({apply / total:.0%})".replace("%", " %"))
    says(CH, f"{split[1][1] + split[1][2]:.2f} ms a step alone and {advance + fill:.2f} ms at 16")
    says(CH, f"At one request *the rest* is {split[1][4]} of the {split[1][0]} ms")
    ours, theirs = map(float, re.search(r"ours \(bitmask.py\) ([\d.]+) ms, xgrammar's CPU kernel ([\d.]+) ms", text).groups())
    says(CH, f"in {ours} ms, {ours / theirs:.1f}× slower")
    walk, fill_ms = map(float, re.search(r"Python walk over 49152 tokens ([\d.]+) ms .* xgrammar's fill ([\d.]+) ms", text).groups())
    says(CH, f"{walk / fill_ms:.0f}× slower")
