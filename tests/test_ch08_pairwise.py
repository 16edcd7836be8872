"""Chapter 08 — every pair of request features, on the tiny model: stream, n, logprobs, echo, response_format,
stop strings, penalties, logit_bias, seed, temperature, max_tokens at its edges, speculative decoding, prefix-cache
hits, a tenant's key, a timeout, a disconnect, tools with each tool_choice and one invalid field at a time, crossed pairwise
(nanoserve/bench/pairwise.py) and sent through the official openai client and raw HTTP. Each answer is a 200 whose
body or every stream event is strict JSON (no NaN, no Infinity) in OpenAI's shape, or a 4xx in OpenAI's error
format naming the field; never a 5xx; after each request none is running and every KV block is free."""

import itertools
import json
import math
import time

import httpx
import pytest

from nanoserve.bench import pairwise
from nanoserve.bench.pairwise import FACTORS, KEYS, covering_rows, expected, problems, request_body, send, strict_loads
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.limits import Tenant
from nanoserve.server.runner import serving
from tests.test_ch08_server import assert_pool_whole, slow_steps
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)

DEFAULT_MAX_TOKENS = 8  # the server's --default-max-tokens here: chat without max_tokens stops there
OPERATOR = "pairwise-operator-key"  # with tenants, /metrics is an operator's (chapter 08)


def test_the_rows_cover_every_pair_of_values():
    """Checked by brute force over the features' values, not by the generator's own bookkeeping: every pair of
    values of two features is in a row served whole (no fault), or, for a fault's value, in a row with that
    fault; except the pairs no request can hold (echo on chat, echo with stream, max_tokens 0 without echo...)."""
    rows = covering_rows()
    impossible = []
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            fault = va if a == "fault" else vb if b == "fault" else None
            served = [r for r in rows if r[a] == va and r[b] == vb and (r["fault"] is None or fault is not None)]
            if not served:
                impossible.append((a, va, b, vb))
    assert all(pairwise.allowed(r) for r in rows)
    # what is left uncovered is exactly what cannot be sent (every name below by hand, not by allowed())
    cannot = [("endpoint", "chat", "echo", True), ("stream", "yes", "echo", True), ("stream", "yes+usage", "echo", True),
              ("endpoint", "chat", "max_tokens", 0), ("stream", "yes", "max_tokens", 0),
              ("stream", "yes+usage", "max_tokens", 0), ("echo", False, "max_tokens", 0),
              ("endpoint", "completions", "fault", "image_part"), ("echo", True, "fault", "image_part"),
              ("max_tokens", 0, "fault", "image_part"), ("endpoint", "chat", "fault", "echo_with_stream"),
              ("stream", "no", "fault", "echo_with_stream"), ("echo", True, "fault", "echo_with_stream"),
              ("max_tokens", 0, "fault", "echo_with_stream")]
    # tools are chat's; offered, no response_format beside them; a grammar (a forced call, a response_format), no stop strings
    for choice in ("required", "named", "auto", "none"):
        cannot += [("endpoint", "completions", "tools", choice), ("echo", True, "tools", choice),
                   ("max_tokens", 0, "tools", choice), ("tools", choice, "fault", "echo_with_stream")]
    for choice in ("required", "named", "auto"):
        cannot += [("response_format", rf, "tools", choice) for rf in ("json_object", "json_schema", "choice")]
    for choice in ("required", "named"):  # ("auto" has no grammar here: no tool is strict)
        cannot += [("stop", "\n", "tools", choice), ("stop", [".", "!", "?", ","], "tools", choice)]
    for rf in ("json_object", "json_schema", "choice"):
        cannot += [("response_format", rf, "stop", "\n"), ("response_format", rf, "stop", [".", "!", "?", ","])]
    key = lambda t: tuple(json.dumps(x) for x in t)  # noqa: E731 (a stop list is a value too)
    assert {key(t) for t in impossible} == {key(t) for t in cannot}, sorted({key(t) for t in impossible} ^ {key(t) for t in cannot})
    product = 1
    for values in FACTORS.values():
        product *= len(values)
    assert len(rows) < 64 < product  # a few dozen requests instead of millions
    assert {r["client"] for r in rows} == {"openai", "http"}


def test_strict_loads_refuses_what_python_json_lets_through():
    assert json.loads('{"logprob": -Infinity}') == {"logprob": float("-inf")}  # Python's parser takes it
    for text in ('{"logprob": -Infinity}', '[NaN]', '{"a": Infinity}'):
        with pytest.raises(ValueError):
            strict_loads(text)


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    """One server for the whole crossing: speculation on (n-gram), prefix caching on, a plain key and a tenant's."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=96, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=4),
                                          speculative_config=SpeculativeConfig(method="ngram", disable_by_batch_size=None)), tokenizer)
    slow_steps(engine, 0.005)  # a stream lasts long enough to be left mid-way
    with serving(engine, tokenizer, model_name="tiny", api_key=KEYS["plain"],
                 api_keys={KEYS["tenant"]: Tenant("acme"), OPERATOR: Tenant("ops", role="operator")},
                 default_max_tokens=DEFAULT_MAX_TOKENS) as (url, srv):
        yield url, srv, engine


ROWS = covering_rows()


def test_every_pair_of_features_is_answered_right_and_leaves_nothing_behind(server):
    url, srv, engine = server
    found, statuses = [], []
    for i, row in enumerate(ROWS):
        body = request_body(row, i, "tiny")
        status, raw = send(row, body, url)
        statuses.append(status)
        found += [f"row {i} {row}: {p}" for p in problems(row, body, status, raw, DEFAULT_MAX_TOKENS)]
        assert_pool_whole(engine)  # no request running, no KV block held (an abort lands within a step)
        # and no stream left: a client that left before the engine thread took its add leaves the add in the
        # inbox for a moment (no sequence yet); the abort that follows clears it at the next step boundary
        deadline = time.monotonic() + 60
        while srv.state.engine.num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.state.engine.num_unfinished_requests() == 0
    assert not found, "\n".join(found)
    # the crossing did serve: most requests got the status they were due (the rest left before their answer)
    due = [expected(row)[0] for row in ROWS]
    assert sum(s == d for s, d in zip(statuses, due)) >= len(ROWS) - sum(r["disconnect"] for r in ROWS)
    assert {200, 400, 408} <= set(statuses)
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text
    assert 'status="5xx"' not in metrics and 'status="2xx"' in metrics  # nothing answered 5xx, not even to a client that had left
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_masked_tokens_never_reach_top_logprobs(server):
    """The 500 the crossing found: a grammar allows a few tokens, top_logprobs asks for 5. The forbidden tokens have
    probability 0 (log p = -inf, not JSON): they are left out, and those listed carry all the probability."""
    url, _, engine = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "structured_outputs": {"choice": ["yes"]}}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream},
                       headers={"Authorization": f"Bearer {KEYS['plain']}"}, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [strict_loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
            entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        else:
            entries = strict_loads(r.text)["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in entries).startswith("yes")
        for e in entries:  # a few tokens spell "yes" ("y", "yes", ...), then only the end: never 5 alternatives
            tops = e["top_logprobs"]
            assert 1 <= len(tops) < 5 and e["token"] in [t["token"] for t in tops]
            # fewer than asked: these are all the tokens the grammar allows, so their probabilities sum to 1
            assert abs(sum(math.exp(t["logprob"]) for t in tops) - 1) < 1e-4
    assert_pool_whole(engine)
