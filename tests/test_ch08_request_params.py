"""Chapter 08 — exercise 8.1: a validated request becomes the engine's SamplingParams, or a 400 in OpenAI's
error format that names the field. Graded: `make grade CH=08 EX=8.1` runs these against
exercises/08-http-serving/request_params.py — first the function alone, on hand-built requests with the
expected SamplingParams written out, then inside the real server (a tiny random model, the real tokenizer,
httpx over loopback)."""

import json

import httpx
import pytest

from nanoserve.sampling import SamplingParams
from nanoserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoserve.server.runner import serving
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.student import implementation
from tests.test_ch08_contract import reference_prompt_logprobs
from tests.test_ch08_server import assert_openai_error, assert_pool_whole, chat_body, graded
from tests.test_ch08_server import engine, tiny, tokenizer  # noqa: F401  (fixtures)

HI = [{"role": "user", "content": "Hi"}]


def to_params(req, num_prompt_tokens=37, max_seq_len=2048, max_request_tokens=65536):
    return implementation("nanoserve.server.request_params").to_sampling_params(
        req, num_prompt_tokens, max_seq_len, max_request_tokens)


def refused(req, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        to_params(req, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.exercise("8.1")
def test_every_field_reaches_the_sampling_params():
    req = ChatCompletionRequest(messages=HI, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\nUser:"], n=2,
                                presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.05,
                                ignore_eos=True, stop_token_ids=[7], logit_bias={"42": -100.0, "7": 2.5},
                                logprobs=True, top_logprobs=2, max_completion_tokens=12)
    assert to_params(req) == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=12, stop=["\nUser:"], stop_token_ids=[7],
        ignore_eos=True, n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        logit_bias={42: -100.0, 7: 2.5}, min_p=0.05, logprobs=2)
    done = to_params(CompletionRequest(prompt="Once", logprobs=3, max_tokens=5, stop="."))
    assert (done.max_tokens, done.logprobs, done.stop, done.temperature, done.n) == (5, 3, ["."], 1.0, 1)
    assert (done.prompt_logprobs, done.structured) == (None, None)  # no echo, no grammar
    # the grammar (chapter 13's, through the request's helper): response_format on chat, vLLM's
    # structured_outputs on completions
    req = ChatCompletionRequest(messages=HI, max_tokens=8, response_format={"type": "json_object"})
    assert to_params(req) == SamplingParams(max_tokens=8, structured=StructuredOutputsParams(json_object=True))
    req = CompletionRequest(prompt="Once", max_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    assert to_params(req).structured == StructuredOutputsParams(choice=["yes", "no"])
    # completions' echo with logprobs N scores the prompt too: prompt_logprobs N
    assert to_params(CompletionRequest(prompt="Once", echo=True, logprobs=2, max_tokens=3)) == SamplingParams(
        max_tokens=3, logprobs=2, prompt_logprobs=2)


@pytest.mark.exercise("8.1")
def test_max_tokens_defaults_per_endpoint():
    # chat without max_tokens: the room the prompt leaves (2048 - 37); completions: OpenAI's 16
    assert to_params(ChatCompletionRequest(messages=HI)).max_tokens == 2011
    assert to_params(ChatCompletionRequest(messages=HI), num_prompt_tokens=2047).max_tokens == 1
    assert to_params(CompletionRequest(prompt="Once")).max_tokens == 16
    # a prompt past what a request may hold is the prompt's fault, whatever max_tokens is (given or the default)
    assert refused(CompletionRequest(prompt="Once"), num_prompt_tokens=4000).param == "prompt"
    assert to_params(ChatCompletionRequest(messages=HI, max_tokens=9)).max_tokens == 9


@pytest.mark.exercise("8.1")
def test_refusals_name_the_field():
    e = refused(ChatCompletionRequest(messages=HI), num_prompt_tokens=2048)
    assert e.param == "messages" and "2048" in e.message
    e = refused(ChatCompletionRequest(messages=HI), num_prompt_tokens=3000)
    assert e.param == "messages" and "3000" in e.message and "2048" in e.message
    assert refused(ChatCompletionRequest(messages=HI, max_tokens=4), num_prompt_tokens=3000).param == "messages"
    # n * max_tokens: 16 * 8192 > 65536, but 8 * 8192 is allowed (the bound is inclusive)
    assert refused(ChatCompletionRequest(messages=HI, n=16, max_tokens=8192)).param == "n"
    # max_tokens alone past the bound: that is the field to change, whatever n is
    assert refused(ChatCompletionRequest(messages=HI, max_tokens=10**9)).param == "max_tokens"
    assert refused(ChatCompletionRequest(messages=HI, n=2, max_completion_tokens=10**9)).param == "max_completion_tokens"
    assert to_params(ChatCompletionRequest(messages=HI, n=8, max_tokens=8192)).n == 8
    # the default counts too: 4 completions of the 2011 left > 8000
    assert refused(ChatCompletionRequest(messages=HI, n=4), max_request_tokens=8000).param == "n"
    # what SamplingParams refuses is a 400 naming its field, not a 500
    e = refused(ChatCompletionRequest(messages=HI, stop=[""]))
    assert e.param == "stop" and "stop" in e.message
    assert refused(ChatCompletionRequest(messages=HI, top_logprobs=2)).param == "top_logprobs"  # needs logprobs


@pytest.mark.exercise("8.1")
def test_the_server_answers_with_the_graded_params(engine, tokenizer, tiny):
    # the function alone first, with this server's numbers: 48 blocks of 16 = 768 tokens per request
    assert to_params(ChatCompletionRequest(messages=HI), 20, 768, 4096).max_tokens == 748
    with serving(engine, tokenizer, model_name="tiny", max_request_tokens=4096) as (url, server):
        graded(server, "nanoserve.server.request_params")
        error = assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=chat_body(stop=[""])), 400)
        assert error["param"] == "stop" and error["type"] == "BadRequestError"
        error = assert_openai_error(httpx.post(f"{url}/v1/chat/completions",
                                               json=chat_body(n=8, max_tokens=600)), 400)
        assert error["param"] == "n" and "8 * 600" in error["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon", "n": 2, "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        assert reply["usage"]["completion_tokens"] == 6  # max_tokens reached the engine: 3 each
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon", "temperature": 0, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # completions' default
        # the grammar reached the engine: a JSON object, where the tiny random model alone writes word pieces
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=64, response_format={
            "type": "json_object"}), timeout=60)
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
        # the prompt logprobs reached it: echo scores every prompt token after the first, as plain torch does
        prompt = "Once upon a time"
        ids, ref = tokenizer.encode(prompt), reference_prompt_logprobs(tiny, tokenizer.encode(prompt))
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1,
                                                      "max_tokens": 0}, timeout=60)
        assert r.status_code == 200, r.text
        scored = r.json()["choices"][0]["logprobs"]
        assert scored["tokens"] == [tokenizer.decode([t]) for t in ids] and scored["token_logprobs"][0] is None
        assert scored["token_logprobs"][1:] == pytest.approx([float(ref[p - 1, ids[p]]) for p in range(1, len(ids))],
                                                            abs=1e-4)
    assert_pool_whole(engine)
