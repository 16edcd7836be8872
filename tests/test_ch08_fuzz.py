"""Chapter 08 — property-based fuzzing of request bodies through raw HTTP (hypothesis, the tiny model): whatever
the body — valid, nearly valid, hostile — the answer is never a 5xx, it is OpenAI's error shape when it is an
error, the server keeps serving, and the KV pool is whole after each case."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.protocol import UNSUPPORTED
from nanoserve.server.runner import serving
from tests.test_ch08_server import assert_pool_whole
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)

scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                                           inner, max_size=3),
                        max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                                 "content": st.text(max_size=30) | anything})
FIELDS = {  # plausible values of every field, and anything at all now and then
    "messages": st.lists(message, min_size=0, max_size=3),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 50000), max_size=5),
    "max_tokens": st.integers(-2, 6), "max_completion_tokens": st.integers(-2, 6),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 60000),
    "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-2**63, 2**63), "n": st.integers(-1, 4),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(st.integers(-5, 50000).map(str) | st.text(max_size=4), st.floats(-200, 200),
                                  max_size=4),
    "logprobs": st.booleans() | st.integers(-2, 25), "top_logprobs": st.integers(-2, 25),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(-5, 50000), max_size=3),
    "user": st.text(max_size=5), "store": st.booleans(), "metadata": anything, "timeout": st.floats(-1, 5),
    "model": st.sampled_from(["tiny", "gpt-4"]), "best_of": st.integers(0, 3),
    **{name: anything for name in list(UNSUPPORTED)[:4]}, "no_such_field": anything,
}
bodies = st.fixed_dictionaries({}, optional={k: v | anything if k == "messages" else v for k, v in FIELDS.items()})


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, engine


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(body=bodies, endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       mangle=st.sampled_from([None, None, None, "truncate", "bytes"]))
def test_no_body_gets_a_5xx_and_nothing_is_left_behind(server, body, endpoint, mangle):
    http, engine = server
    raw = json.dumps(body).encode()
    if mangle == "truncate":
        raw = raw[: len(raw) // 2]
    elif mangle == "bytes":
        raw = raw.replace(b"a", b"\xff")
    r = http.post(endpoint, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    assert_pool_whole(engine)
    assert http.get("/health").status_code == 200


def test_a_short_soak_leaves_no_5xx_no_block_and_serves_every_kind(tiny, tokenizer):
    from nanoserve.bench.soak import soak_engine

    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    result = soak_engine(engine, tokenizer, duration=8, concurrency=4)
    assert result["5xx"] == 0 and result["running"] == 0 and result["kv_usage"] == 0
    seen = {k.split(": ")[0] + ": " + k.split(": ")[1].split(" ")[0] for k in result["outcomes"]}
    assert {"good: 200", "malformed: 400", "cancelled: cancelled"} <= seen, result["outcomes"]
    assert any(k.startswith("limited: 429") for k in result["outcomes"]), result["outcomes"]
    hostile = {k: n for k, n in result["outcomes"].items() if k.startswith("hostile: ")}  # chapter 15's tenant
    due = {"seed past 2**64": "400", "NaN": "400", "lone surrogate": "400", "text/plain": "415",
           "n x max_tokens": "400", "another tenant's salt": "200", "metrics": "403", "engine view": "200"}
    # each attack gets its own answer (a refused one its 4xx, an allowed one 200), never another's
    assert hostile and all(k.split(" ", 2)[1] == due[k.split(" ", 2)[2]] for k in hostile), hostile
    assert_pool_whole(engine)
