"""Chapter 08 — exercise 8.2: one request's SSE stream, from engine outputs to OpenAI chunks, with the
stop-string hold-back, for one completion and for n > 1 interleaved ones. Graded: `make grade CH=08 EX=8.2`
runs these against exercises/08-http-serving/streaming.py.

The engine outputs are scripted here: token texts arrive one per step and chapter 03's stop check
(nanoserve/text/stop.py, the engine's own rule) decides when the request ends and where its text is cut."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.llm_engine import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.text.stop import find_stop_string
from nanoserve.student import implementation


def streaming():
    return implementation("nanoserve.server.streaming")


def engine_outputs(pieces: list[str], stop: list[str], prompt=(1, 2, 3)) -> list[RequestOutput]:
    """What LLMEngine emits for a request whose tokens decode to `pieces`: cumulative text, cut before
    the first stop string (then finished "stop"), else finished "length" after the last piece."""
    params, outs, text = SamplingParams(stop=stop), [], ""
    for i, piece in enumerate(pieces):
        text += piece
        cut = find_stop_string(text, params)
        finished = cut is not None or i == len(pieces) - 1
        if cut is not None:
            text = text[:cut]
        outs.append(RequestOutput("r", list(prompt), list(range(i + 1)), [i], text, piece, finished,
                                  ("stop" if cut is not None else "length") if finished else None))
        if finished:
            break
    return outs


async def aiter(items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def deltas(outs, stop):
    async def collect():
        return [(d, o.finished) async for d, o in streaming().text_deltas(aiter(outs), stop)]

    return asyncio.run(collect())


def sse_events(outs, stop, kind="chat", include_usage=False):
    async def collect():
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        return [line async for line in streaming().openai_stream(aiter(outs), stop, kind, base, include_usage)]

    lines = "".join(asyncio.run(collect()))
    events = lines.split("\n\n")
    assert events[-1] == "", "every event ends with a blank line"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


# ---- 8.2 (a) the hold-back -------------------------------------------------------------------------
@pytest.mark.exercise("8.2")
@pytest.mark.parametrize("text, stop, held", [
    ("Hello.\nUs", ["\nUser:"], 3),       # "\nUs" could still become "\nUser:"
    ("Hello", ["\nUser:"], 0),
    ("abab", ["abc"], 2),                 # "ab" starts "abc"; "b" alone does not
    ("xya", ["ab", "yab"], 2),            # the longest over all stop strings: "ya" of "yab"
    ("Hi", [], 0),
    ("", ["a"], 0),
    ("end.", ["."], 0),                   # a whole stop string is not held: it would have stopped the request
])
def test_stop_hold_back_worked_examples(text, stop, held):
    assert streaming().stop_hold_back(text, stop) == held


@pytest.mark.exercise("8.2")
@settings(max_examples=200, deadline=None)
@given(st.text("ab\n", max_size=8), st.lists(st.text("ab\n", min_size=1, max_size=4), max_size=3))
def test_stop_hold_back_is_the_longest_tail_that_starts_a_stop_string(text, stop):
    expected = max([k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
    assert streaming().stop_hold_back(text, stop) == expected


# ---- 8.2 (b) the deltas ----------------------------------------------------------------------------
@pytest.mark.exercise("8.2")
def test_deltas_hold_back_a_stop_string_that_then_happens():
    outs = engine_outputs(["Hello", ".", "\nUs", "er:", " more"], ["\nUser:"])
    assert outs[-1].text == "Hello." and outs[-1].finish_reason == "stop"
    assert deltas(outs, ["\nUser:"]) == [("Hello", False), (".", False), ("", True)]


@pytest.mark.exercise("8.2")
def test_deltas_release_held_text_that_did_not_become_a_stop_string():
    outs = engine_outputs(["Hello", "\nUs", "ually", " yes"], ["\nUser:"])
    assert deltas(outs, ["\nUser:"]) == [("Hello", False), ("\nUsually", False), (" yes", True)]
    # held to the very end: a request that finishes by length sends the tail it was holding
    outs = engine_outputs(["Hello", "\nUs"], ["\nUser:"])
    assert deltas(outs, ["\nUser:"]) == [("Hello", False), ("\nUs", True)]


@pytest.mark.exercise("8.2")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab\n", max_size=3), min_size=1, max_size=10),
       st.lists(st.text("ab\n", min_size=1, max_size=4), max_size=2))
def test_deltas_concatenate_to_the_final_text_and_never_show_a_stop_string(pieces, stop):
    outs = engine_outputs(pieces, stop)
    got = deltas(outs, stop)
    final = outs[-1].text
    assert "".join(d for d, _ in got) == final  # streamed == non-streamed
    assert [f for _, f in got].count(True) == 1 and got[-1][1]
    sent = ""
    for d, _ in got:
        sent += d
        assert final.startswith(sent)  # never a character the final answer does not have
    assert all(d for d, finished in got if not finished), "no empty deltas except the last"


def interleaved(*completions: list[str], stop: list[str]) -> list[RequestOutput]:
    """n > 1: the outputs of each completion (engine_outputs of its pieces, index i), step by step as the engine
    interleaves them; `finished` only on the very last output of the request (each completion's own end is its
    finish_reason)."""
    per = [engine_outputs(pieces, stop) for pieces in completions]
    outs = []
    for step in range(max(len(p) for p in per)):
        for i, p in enumerate(per):
            if step < len(p):
                o = p[step]
                outs.append(RequestOutput("r", o.prompt_token_ids, o.token_ids, o.new_token_ids, o.text, o.new_text,
                                          False, o.finish_reason, index=i))
    outs[-1].finished = True
    return outs


def deltas_by_index(outs, stop):
    async def collect():
        return [(o.index, d, o.finish_reason) async for d, o in streaming().text_deltas(aiter(outs), stop)]

    return asyncio.run(collect())


@pytest.mark.exercise("8.2")
def test_with_n_2_a_completion_that_ends_first_keeps_its_held_tail():
    # completion 0 ends by length two steps before the request does, holding "\nUs" (it could have become
    # "\nUser:"); completion 1 goes on and meets the stop string
    outs = interleaved(["Hello", "\nUs"], ["Hi", " you", "\nUs", "er:"], stop=["\nUser:"])
    assert not any(o.finished for o in outs[:-1]) and outs[1].finish_reason is None
    got = deltas_by_index(outs, ["\nUser:"])
    assert [(i, d) for i, d, _ in got if i == 0] == [(0, "Hello"), (0, "\nUs")]  # its tail, at its own end
    assert [(i, d) for i, d, _ in got if i == 1] == [(1, "Hi"), (1, " you"), (1, "")]
    assert [r for i, _, r in got if r] == ["length", "stop"]


@pytest.mark.exercise("8.2")
@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.text("ab\n", max_size=3), min_size=1, max_size=6), min_size=2, max_size=3),
       st.lists(st.text("ab\n", min_size=1, max_size=3), max_size=2))
def test_n_completions_each_stream_exactly_their_final_text(completions, stop):
    outs = interleaved(*completions, stop=stop)
    got = deltas_by_index(outs, stop)
    for i in range(len(completions)):
        final = [o.text for o in outs if o.index == i][-1]
        mine = [(d, r) for j, d, r in got if j == i]
        assert "".join(d for d, _ in mine) == final
        assert [r is not None for _, r in mine].count(True) == 1 and mine[-1][1] is not None
        sent = ""
        for d, _ in mine:
            sent += d
            assert final.startswith(sent)


@pytest.mark.exercise("8.2")
def test_chat_stream_with_n_2_gives_each_completion_its_role_index_and_tail():
    outs = interleaved(["Hello", "\nUs"], ["Hi", " you", "\nUs", "er:"], stop=["\nUser:"])
    chunks = [json.loads(e) for e in sse_events(outs, ["\nUser:"], include_usage=True)[:-1]]
    choices = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
               for c in chunks if c["choices"]]
    for i, text, reason in ((0, "Hello\nUs", "length"), (1, "Hi you", "stop")):
        mine = [(d, r) for j, d, r in choices if j == i]
        assert mine[0] == ({"role": "assistant", "content": ""}, None)  # each completion's first chunk: its role
        assert "".join(d["content"] for d, _ in mine[1:]) == text and mine[-1][1] == reason
        assert all(r is None for _, r in mine[:-1])
    # the prompt (3 tokens) counts once; the completions' tokens (2 + 4) add up
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                                                   "total_tokens": 9}


# ---- 8.2 (c) the SSE lines ---------------------------------------------------------------------------
@pytest.mark.exercise("8.2")
def test_chat_stream_is_openai_chunks_then_done():
    outs = engine_outputs(["Hi", " there", "\nUs", "er:"], ["\nUser:"])
    events = sse_events(outs, ["\nUser:"])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the role comes first
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hi there"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("usage" not in c for c in chunks)


@pytest.mark.exercise("8.2")
def test_include_usage_adds_a_final_usage_chunk():
    outs = engine_outputs(["a", "b", "c"], [], prompt=(1, 2, 3, 4))
    chunks = [json.loads(e) for e in sse_events(outs, [], include_usage=True)[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                                                   "total_tokens": 7}
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI sends usage: null on the others


@pytest.mark.exercise("8.2")
def test_completion_stream_carries_text():
    outs = engine_outputs(["Once", " upon"], [])
    chunks = [json.loads(e) for e in sse_events(outs, [], kind="completion")[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["Once", " upon"]  # no role chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.exercise("8.2")
def test_an_error_after_the_stream_began_is_one_error_event_then_done():
    outs = engine_outputs(["Hi", " there", " you"], [])[:2]
    events = sse_events([*outs, RuntimeError("the step failed")], [])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "the step failed" in error["message"] and error["code"] == 500 and {"type", "param"} <= set(error)
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]) == "Hi there"
