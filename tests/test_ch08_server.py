"""Chapter 08 — the HTTP server on a tiny random model (the real tokenizer, so the chat template and
the ids are the real ones): a real uvicorn server on a free loopback port per test, raw HTTP through
httpx and the official openai client. Auth, backpressure (503 / 429 / 413), malformed input,
disconnects, metrics, errors in a step, graceful shutdown, and the CLI's refusals."""

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.protocol import APIError
from nanoserve.server.runner import serving
from nanoserve.student import implementation
from tests.test_student import exercises  # noqa: F401  (fixture: a copy of exercises/ the loader reads)
from tests.tiny_model import tiny_llama

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from nanoserve.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=49152, max_position_embeddings=1024)


@pytest.fixture
def engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16),
                                        scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)


def slow_steps(engine, seconds=0.01):
    """Pace the tiny model's steps like a real one's, so a stream lasts long enough to interrupt."""
    execute = engine.executor.execute_model

    def paced(scheduler_output):
        time.sleep(seconds)
        return execute(scheduler_output)

    engine.executor.execute_model = paced


def assert_pool_whole(engine, timeout=60.0):
    """Within a few steps (an abort lands at the next step boundary) nothing is left. The deadline is generous: a
    loaded CI machine may take seconds to notice a hang-up; a passing run waits only as long as the engine takes."""
    deadline = time.monotonic() + timeout
    while (engine.scheduler.seqs or engine.block_manager.get_num_free_blocks() != engine.block_manager.num_blocks) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.scheduler.seqs, f"requests left behind: {list(engine.scheduler.seqs)}"
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"


def graded(server, module: str):
    """Swap the graded `module` into a running server: under `make grade` the learner's file (even a stub, which
    a real --student run would replace by the reference), else the reference. Only that one module: every other
    rung stays the reference's, so a rung is graded on its own."""
    state, mod = server.state, implementation(module)
    attr = {"nanoserve.server.request_params": "request_params", "nanoserve.server.streaming": "streaming",
            "nanoserve.server.limits": "limits"}[module]
    setattr(state, attr, mod)
    if attr == "limits" and state.limiter is not None:
        state.limiter = mod.TokenBucketLimiter(state.config.rate_limit, state.config.rate_burst)
    return server


def chat_body(**kw):
    return {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 0, **kw}


def assert_openai_error(r: httpx.Response, status: int):
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == status
    return error


def test_models_health_tokenize_detokenize(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        models = openai.OpenAI(base_url=f"{url}/v1", api_key="none").models.list()
        assert [m.id for m in models.data] == ["tiny"]
        r = httpx.post(f"{url}/tokenize", json={"messages": HI}).json()
        assert r["tokens"] == tokenizer.encode_chat(HI) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
        assert tokenizer.decode(r["tokens"]).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        assert httpx.post(f"{url}/detokenize", json={"tokens": tokenizer.encode("Hello world")}).json() == \
            {"prompt": "Hello world"}


def test_models_retrieve_default_max_tokens_and_fields_named_in_errors(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", default_max_tokens=5) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        card = client.models.retrieve("tiny")
        assert card.id == "tiny" and card.model_extra["default_max_tokens"] == 5
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-4")
        assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]
        # chat without max_tokens stops at the server's default; completions keep OpenAI's 16
        reply = client.chat.completions.create(model="tiny", messages=HI, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
        for body, param, words in [
            (chat_body(max_tokens=10**9), "max_tokens", "1 * 1000000000"),  # alone past the bound: not n's fault
            (chat_body(logit_bias={"99999": 1}), "logit_bias", "outside the vocabulary"),
            (chat_body(stop_token_ids=[49152]), "stop_token_ids", "outside the vocabulary"),
            (chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                               {"type": "image_url", "image_url": {"url": "x"}}]}]),
             "messages[0].content", "this server serves a text model"),
        ]:
            error = assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
            assert error["param"] == param and words in error["message"], error
        assert_pool_whole(engine)


def test_a_batch_of_prompts_answers_each_as_alone(engine, tokenizer):
    """OpenAI's legacy batch: prompt i's n choices are indices i*n ... i*n+n-1, each what the prompt gets alone."""
    prompts = ["Once upon a time", "The capital of France", "def add(a, b):"]
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        args = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        alone = [client.completions.create(prompt=p, **args) for p in prompts]
        together = client.completions.create(prompt=prompts, n=2, echo=True, **args)
        assert [c.index for c in together.choices] == list(range(6))
        assert [c.text for c in together.choices] == [p + a.choices[0].text for p, a in zip(prompts, alone) for _ in "ab"]
        assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert together.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
        ids = [tokenizer.encode(p) for p in prompts]  # a batch of token-id prompts: the same texts
        by_ids = client.completions.create(prompt=ids, **args)
        assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
        for body in ({"prompt": prompts, "stream": True}, {"prompt": ["a", ""]}, {"prompt": ["a"] * 17},
                     {"prompt": ["a", "b" * 5000], "max_tokens": 4},  # the second is too long: the batch is refused
                     {"prompt": ["a"] * 16, "n": 16, "max_tokens": 300}):  # 4 800 each, 76 800 > 65 536 together
            assert assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 400)["param"] == "prompt"
        assert_pool_whole(engine)


def test_chat_and_completions_with_the_openai_client(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 6
        assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(HI))
        stream = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content
        # the list-of-parts form of content reads as the same text
        parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
        again = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
        assert again.choices[0].message.content == reply.choices[0].message.content
        done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0)
        streamed = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
        assert done.usage.prompt_tokens == len(tokenizer.encode("Once upon"))
    assert_pool_whole(engine)


def test_n_completions_are_their_seeds_alone_streamed_or_not(engine, tokenizer):
    """n=3 (parallel sampling, chapter 06): choice i is what seed + i gets alone; streamed choices carry
    their index and concatenate to the same texts; usage counts every completion's tokens."""
    sampling = {"max_tokens": 5, "temperature": 0.8, "seed": 11, "extra_body": {"ignore_eos": True}}
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=HI, n=3, **sampling)
        assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens == 3 * 5
        alone = [client.chat.completions.create(model="tiny", messages=HI, **{**sampling, "seed": 11 + i})
                 .choices[0].message.content for i in range(3)]
        assert [c.message.content for c in reply.choices] == alone
        texts, reasons, roles = {}, {}, []
        for chunk in client.chat.completions.create(model="tiny", messages=HI, n=3, stream=True, **sampling):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                roles += [c.index] if c.delta.role else []
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        assert [texts[i] for i in range(3)] == alone and sorted(roles) == [0, 1, 2]
        assert reasons == {0: "length", 1: "length", 2: "length"}
        done = client.completions.create(model="tiny", prompt="Once upon", n=2, **sampling)
        streamed = {}
        for chunk in client.completions.create(model="tiny", prompt="Once upon", n=2, stream=True, **sampling):
            streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
        assert [streamed[0], streamed[1]] == [c.text for c in done.choices]
    assert_pool_whole(engine)


def test_api_key(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", api_key="s3cret", metrics_need_key=False) as (url, _):
        assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=chat_body()), 401)
        assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=chat_body(),
                                       headers={"Authorization": "Bearer s3cre"}), 401)
        assert_openai_error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401)
        assert_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices
        assert httpx.get(f"{url}/health").status_code == 200  # open: load balancers probe it
        assert httpx.get(f"{url}/metrics").status_code == 200
    with serving(engine, tokenizer, model_name="tiny", api_key="s3cret", metrics_need_key=True) as (url, _):
        assert_openai_error(httpx.get(f"{url}/metrics"), 401)
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.exercise("8.4")
def test_full_queue_is_503_with_retry_after_before_any_tokenizing(tiny, tokenizer, monkeypatch):
    limits = implementation("nanoserve.server.limits")
    assert limits.check_queue(0, 1, 1) is None and limits.check_queue(5, None, 1) is None
    with pytest.raises(APIError) as e:
        limits.check_queue(3, 3, 7)
    assert (e.value.status, e.value.headers) == (503, {"Retry-After": "7"}) and "3" in e.value.message
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=1)), tokenizer)
    slow_steps(engine, 0.05)  # the running request's 400 tokens last 20 s or more: it cannot end before the refusal
    with serving(engine, tokenizer, model_name="tiny", max_waiting_requests=1) as (url, server):
        graded(server, "nanoserve.server.limits")
        long = chat_body(max_tokens=400, ignore_eos=True, stream=True)
        async_engine = server.state.engine

        def wait_for(condition):
            deadline = time.monotonic() + 60
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.01)

        with httpx.Client() as a, httpx.Client() as b, \
                a.stream("POST", f"{url}/v1/chat/completions", json=long) as running:
            wait_for(lambda: async_engine.num_requests_running == 1)
            with b.stream("POST", f"{url}/v1/chat/completions", json=long) as waiting:
                assert running.status_code == waiting.status_code == 200
                wait_for(lambda: async_engine.num_requests_waiting == 1)
                calls = []
                monkeypatch.setattr(tokenizer, "encode_chat", lambda *a, **k: calls.append(a))
                r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
                assert_openai_error(r, 503)
                assert r.headers["retry-after"] == "1" and calls == []
                monkeypatch.undo()
        # both clients hung up: their requests are aborted
    assert_pool_whole(engine)


def test_queue_bound_counts_requests_not_their_n_completions(tiny, tokenizer):
    """--max-waiting-requests counts requests: an n = 4 request running as 4 sequences is one request with a seat,
    and the n = 1 request behind it (no seat left of 4) is the one waiting, so the next one is refused."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=256, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    slow_steps(engine, 0.05)  # 400 tokens last 20 s or more: the n = 4 request cannot end before the refusal
    with serving(engine, tokenizer, model_name="tiny", max_waiting_requests=1) as (url, server):
        async_engine = server.state.engine

        def until(condition):
            deadline = time.monotonic() + 60
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert condition()

        body = chat_body(max_tokens=400, ignore_eos=True, stream=True, temperature=1.0, seed=0)
        with httpx.Client() as a, httpx.Client() as b, \
                a.stream("POST", f"{url}/v1/chat/completions", json={**body, "n": 4}) as four:
            # forked: its 4 completions take every seat (and the engine thread has published its counts: the
            # scheduler's queues change inside a step, the published snapshot after it)
            until(lambda: len(engine.scheduler.running) == 4 and async_engine.num_requests_running == 1)
            assert (async_engine.num_requests_running, async_engine.num_requests_waiting) == (1, 0)
            with b.stream("POST", f"{url}/v1/chat/completions", json=body) as one:
                assert four.status_code == one.status_code == 200
                until(lambda: async_engine.num_requests_waiting == 1)
                assert len(engine.scheduler.waiting) == 1 and async_engine.num_requests_running == 1
                r = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
                error = assert_openai_error(r, 503)
                assert "1 requests are waiting (max 1)" in error["message"]
    assert_pool_whole(engine)


@pytest.mark.exercise("8.4")
def test_rate_limit_is_429_with_retry_after(engine, tokenizer):
    limits = implementation("nanoserve.server.limits")
    e = limits.too_many_requests(2.25, "slow down")
    assert (e.status, e.message, e.headers) == (429, "slow down; retry in 2.25 s", {"Retry-After": "3"})
    assert limits.too_many_requests(0.01, "x").headers == {"Retry-After": "1"}  # never 0
    assert limits.too_many_requests(3.0, "x").headers == {"Retry-After": "3"}  # whole seconds stay as they are
    with serving(engine, tokenizer, model_name="tiny", rate_limit=0.1, rate_burst=2) as (url, server):  # 1 per 10 s
        graded(server, "nanoserve.server.limits")
        codes = [httpx.get(f"{url}/v1/models").status_code for _ in range(2)]
        r = httpx.get(f"{url}/v1/models")
        assert codes == [200, 200]
        error = assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "10" and error["type"] == "RateLimitError"  # (1 - 0) / 0.1 s, rounded up
        assert httpx.get(f"{url}/health").status_code == 200  # health is not rate limited


MALFORMED = [  # (body, expected status, expected param or None)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'"hello"', 400, None),
    (b"", 400, None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),  # invalid UTF-8
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "Hi"}, 400, "messages"),
    ({"messages": ["Hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "Hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content"),
    (chat_body(temperature="hot"), 400, "temperature"),
    (chat_body(temperature=-1), 400, "temperature"),
    (chat_body(top_p=0), 400, "top_p"),
    (chat_body(top_p=1.5), 400, "top_p"),
    (chat_body(top_k="3"), 400, "top_k"),
    (chat_body(max_tokens=0), 400, "max_tokens"),
    (chat_body(max_tokens="10"), 400, "max_tokens"),
    (chat_body(max_tokens=2.5), 400, "max_tokens"),
    (chat_body(max_tokens=True), 400, "max_tokens"),
    (chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
    (chat_body(seed="x"), 400, "seed"),
    (chat_body(stop=5), 400, "stop"),
    (chat_body(stop=[""]), 400, "stop"),
    (chat_body(n=0), 400, "n"),
    (chat_body(presence_penalty=2.5), 400, "presence_penalty"),
    (chat_body(frequency_penalty="x"), 400, "frequency_penalty"),
    (chat_body(logit_bias={"1": 101}), 400, "logit_bias"),
    (chat_body(logprobs="yes"), 400, "logprobs"),
    (chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (chat_body(min_p=1.5), 400, "min_p"),
    (chat_body(repetition_penalty=0), 400, "repetition_penalty"),
    (chat_body(stop_token_ids=["2"]), 400, "stop_token_ids[0]"),
    (chat_body(timeout=0), 400, "timeout"),
    (chat_body(stream="yes"), 400, "stream"),
    (chat_body(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (chat_body(ignore_eos="no"), 400, "ignore_eos"),
    (chat_body(user=7), 400, "user"),
    (chat_body(model="gpt-4"), 404, "model"),
    (chat_body(max_tokens=5000), 400, "max_tokens"),  # beyond the 1024-token context
    (chat_body(max_tokens=900), 400, "max_tokens"),   # fits the context, never the 48 x 16 = 768-token pool
]


def test_malformed_requests_get_openai_errors_and_leave_nothing_behind(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", max_body_bytes=4096) as (url, _):
        with httpx.Client(base_url=url) as http:
            for body, status, param in MALFORMED:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
                error = assert_openai_error(r, status)
                assert error["param"] == param, (body, error)
            context = assert_openai_error(http.post("/v1/chat/completions", json=chat_body(max_tokens=5000)), 400)
            assert "5000" in context["message"] and "1024" in context["message"]  # names both numbers
            others = [
                (http.post("/v1/chat/completions", content=b"x" * 5000), 413),          # oversized body
                (http.post("/v1/completions", json={"prompt": 5}), 400),
                (http.post("/v1/completions", json={"prompt": [1, 49152], "max_tokens": 2}), 400),  # not a token id
                (http.post("/v1/completions", json={"max_tokens": 2}), 400),
                (http.post("/tokenize", json={}), 400),
                (http.post("/detokenize", json={"tokens": [-1]}), 400),
                (http.post("/detokenize", json={"tokens": "abc"}), 400),
                (http.get("/v1/chat/completions"), 405),
                (http.post("/v1/nowhere", json={}), 404),
            ]
            for r, status in others:
                assert_openai_error(r, status)
            unknown = assert_openai_error(http.post("/v1/chat/completions", json=chat_body(unknown_field=1)), 400)
            assert unknown["message"] == "Unrecognized request argument supplied: unknown_field"  # OpenAI's words
            good = http.post("/v1/chat/completions", json=chat_body(user="u1", store=False, metadata={"a": "b"}))
            assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"
    assert_pool_whole(engine)


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(engine, tokenizer):
    slow_steps(engine)
    with serving(engine, tokenizer, model_name="tiny") as (url, server):
        aborted = []
        abort = server.state.engine.abort
        server.state.engine.abort = lambda request_id: (aborted.append(request_id), abort(request_id))
        with httpx.Client() as http:
            with http.stream("POST", f"{url}/v1/chat/completions",
                             json=chat_body(max_tokens=400, ignore_eos=True, stream=True)) as r:
                lines = r.iter_lines()
                assert [next(lines) for _ in range(6)]  # a few chunks, then hang up mid-stream
        assert_pool_whole(engine)
        # aborted (more than once is fine: the disconnect, the stream's close and the response's end each say so,
        # and an abort of a finished id is ignored), and only this request
        assert len(set(aborted)) == 1 and aborted[0].startswith("chatcmpl-")
        # a non-streaming request whose client gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=400, ignore_eos=True), timeout=0.5)
        assert_pool_whole(engine)
        assert len(set(aborted)) == 2  # this one too, once or more
        # the engine thread frees an aborted request's blocks before its stat logger counts it: wait for the count
        counted = 'nanoserve:request_success_total{finished_reason="abort",model_name="tiny"} 2.0'
        deadline = time.monotonic() + 60
        while counted not in (scrape := httpx.get(f"{url}/metrics", timeout=60).text) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counted in scrape


def metric_samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} from a Prometheus scrape, parsed by prometheus_client's parser."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_count_a_request(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        before = metric_samples(httpx.get(f"{url}/metrics").text)
        reply = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=5, ignore_eos=True)).json()
        after = metric_samples(httpx.get(f"{url}/metrics").text)
    model = frozenset({("model_name", "tiny")})

    def moved(name, labels=model):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("nanoserve:generation_tokens_total") == reply["usage"]["completion_tokens"] == 5
    assert moved("nanoserve:prompt_tokens_total") == reply["usage"]["prompt_tokens"]
    assert moved("nanoserve:request_success_total", model | {("finished_reason", "length")}) == 1
    assert moved("nanoserve:prefix_cache_queries_total") == reply["usage"]["prompt_tokens"]
    assert moved("nanoserve:time_to_first_token_seconds_count") == 1
    assert moved("nanoserve:inter_token_latency_seconds_count") == 4  # 5 tokens, 4 gaps
    assert moved("nanoserve:e2e_request_latency_seconds_count") == 1
    assert after[("nanoserve:num_requests_running", model)] == 0
    assert after[("nanoserve:kv_cache_usage_perc", model)] == 0
    assert ("nanoserve:num_preemptions_total", model) in after and ("nanoserve:num_requests_waiting", model) in after


def test_an_engine_error_mid_stream_is_an_error_event_and_the_server_keeps_serving(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        execute, steps = engine.executor.execute_model, [0]

        def fails_on_the_third_step(scheduler_output):
            steps[0] += 1
            if steps[0] == 3:
                raise RuntimeError("simulated device fault")
            return execute(scheduler_output)

        engine.executor.execute_model = fails_on_the_third_step
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=50, ignore_eos=True, stream=True)) as r:
            events = [line[len("data: "):] for line in r.iter_lines() if line]
        assert events[-1] == "[DONE]" and "simulated device fault" in json.loads(events[-2])["error"]["message"]
        engine.executor.execute_model = execute
        assert httpx.post(f"{url}/v1/chat/completions", json=chat_body()).status_code == 200
    assert_pool_whole(engine)


def test_graceful_shutdown_drains_a_running_stream(engine, tokenizer):
    slow_steps(engine)
    with serving(engine, tokenizer, model_name="tiny", shutdown_timeout=30) as (url, server):
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=40, ignore_eos=True, stream=True)) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(3)]
            async_engine = server.state.engine  # a stopped server lets its engines go
            stopper = threading.Thread(target=server.stop)
            stopper.start()  # as SIGTERM would: stop listening, let running streams finish
            rest = [line for line in lines if line]
        events = [line[len("data: "):] for line in first + rest if line]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content") is not None) - 1 <= 40
        stopper.join(30)
        assert not stopper.is_alive() and not async_engine.is_running
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{url}/health")
    assert_pool_whole(engine)
    assert not [t.name for t in threading.enumerate() if t.name in ("nanoserve-engine", "nanoserve-http")]


def test_shutdown_past_its_timeout_aborts_what_is_left(engine, tokenizer):
    slow_steps(engine)
    with serving(engine, tokenizer, model_name="tiny", shutdown_timeout=0.3) as (url, server):
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=400, ignore_eos=True, stream=True)) as r:
            lines = r.iter_lines()
            next(lines)
            server.stop()  # returns once the server is down: past 0.3 s it aborts what is left
            events = 0
            with pytest.raises(httpx.HTTPError):
                for line in lines:  # the stream was cut ...
                    events += line.startswith("data: ")
            assert events < 400  # ... before its 400 tokens: the request was aborted, not waited for
    assert_pool_whole(engine)


@pytest.mark.parametrize("args, message", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),  # refused by argparse (each case starts Python and imports torch: few of them)
    (["--rate-limit", "abc"], "--rate-limit"),  # argparse's own refusal, in the same one-line form
])
def test_serve_refuses_bad_arguments_in_one_line_before_loading_the_model(args, message):
    r = subprocess.run([sys.executable, "-m", "nanoserve", "serve", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "loading" not in r.stdout


def test_terminal_chat_through_the_server_keeps_the_conversation(engine, tokenizer):
    from nanoserve.cli.chat import chat_loop, remote_reply
    from nanoserve.sampling import SamplingParams

    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        shown = []
        chat_loop(iter(["Hi\n", "again\n", "exit\n", "never"]), shown.append,
                  remote_reply(client, "tiny", SamplingParams(temperature=0, max_tokens=5)))
        first = client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0).choices[0]
        second = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
            *HI, {"role": "assistant", "content": first.message.content}, {"role": "user", "content": "again"}]).choices[0]
    end = {"stop": "\n", "length": " [max tokens]\n"}
    assert "".join(shown) == (f"assistant> {first.message.content}{end[first.finish_reason]}"
                              f"assistant> {second.message.content}{end[second.finish_reason]}")


def test_terminal_chat_through_the_server_sends_top_k(engine, tokenizer):
    """`chat --url ... --top-k 1` sends top_k (an extra field of the request): at temperature 1 the reply is then
    the greedy one; dropped, a seeded draw from the tiny model's flat distribution would be another."""
    from nanoserve.cli.chat import remote_reply
    from nanoserve.sampling import SamplingParams

    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

        def reply(**params):
            return remote_reply(client, "tiny", SamplingParams(max_tokens=8, seed=3, **params))(HI, lambda text: None)

        greedy, top_1, free = reply(temperature=0), reply(temperature=1.0, top_k=1), reply(temperature=1.0)
    assert top_1 == greedy != free


def test_finished_08_rungs_serve_through_student_08(engine, tokenizer, exercises, capsys):
    """`serve --student 08`: the learner's finished files (here the reference, copied in) answer the requests —
    8.1's params, 8.2's stream, 8.3's bridge, 8.4's limiter — and the run says so; an unfinished one falls back."""
    for module in ("nanoserve.server.request_params", "nanoserve.server.streaming", "nanoserve.engine.async_engine"):
        exercises(module)
    with pytest.warns(UserWarning, match=r"Exercise 8\.4 not finished in exercises/08-http-serving/limits\.py"):
        with serving(engine, tokenizer, model_name="tiny", student="08", rate_limit=100) as (url, server):
            state = server.state
            assert type(state.engine).__module__ == "student_nanoserve_engine_async_engine"
            assert state.request_params.__name__ == "student_nanoserve_server_request_params"
            assert state.streaming.__name__ == "student_nanoserve_server_streaming"
            assert state.limits.__name__ == "nanoserve.server.limits"  # still a stub: the reference's
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(stream=True, n=2), timeout=60) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"
            assert {json.loads(e[6:])["choices"][0]["index"] for e in events[:-1]} == {0, 1}
            calls = state.student.calls
            assert calls["to_sampling_params"] == 1 and calls["openai_stream"] == 1
            assert calls["AsyncLLMEngine.add_request"] == 1 and calls["AsyncLLMEngine._drain_inbox"] > 0
    err = capsys.readouterr().err
    assert "--student 08: the server runs" in err and "yours      to_sampling_params" in err
    assert "reference  nanoserve.server.limits  (exercises/08-http-serving/limits.py still raises" in err
    assert_pool_whole(engine)


def test_a_finished_8_4_limits_through_student_08(engine, tokenizer, exercises):
    """Rung 8.4 served: the learner's TokenBucketLimiter, too_many_requests and check_queue decide the refusals
    (burst 1 at 0.01 requests/s: the second request is the learner's 429, Retry-After 100)."""
    exercises("nanoserve.server.limits")
    with pytest.warns(UserWarning, match=r"Exercise 8\.[123] not finished"), \
            serving(engine, tokenizer, model_name="tiny", student="08", rate_limit=0.01, rate_burst=1) as (url, server):
        state = server.state
        assert state.limits.__name__ == "student_nanoserve_server_limits"
        assert httpx.post(f"{url}/v1/chat/completions", json=chat_body()).status_code == 200
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        assert assert_openai_error(refused, 429) and refused.headers["Retry-After"] == "100"
        calls = state.student.calls
        assert calls["TokenBucketLimiter.try_acquire"] == 2 and calls["too_many_requests"] == 1
        assert calls["check_queue"] == 1  # checked by the route, after the guard let the first request in
    assert_pool_whole(engine)
