"""Chapter 15 — tenants that cannot hurt or read each other, attacked as a hostile tenant would on the tiny model:
one request's failure inside a step fails that request alone (the others in the step finish with the text they
get alone), every field that reaches a tensor or a torch.Generator is bounded at the edge, the prefix cache is
keyed by tenant (a second tenant's cached prefix is no hit for the first), a burst cannot overdraw a token quota,
/metrics and the engine view are an operator's, and nothing listens beyond the server's host unasked."""

import asyncio
import json
import threading

import httpx
import pytest

from nanoserve.engine.llm_engine import EngineConfig, LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.server.runner import serving
from tests.test_ch08_server import assert_openai_error, assert_pool_whole, chat_body
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)


@pytest.fixture
def engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(num_blocks=96, block_size=16, max_num_seqs=8), tokenizer)


class ExplodingParams(SamplingParams):
    """A test-only SamplingParams whose draw raises inside the step (the sampler asks every row `penalized`)."""

    @property
    def penalized(self):
        raise RuntimeError("injected failure in this request's draw")


def record_steps(engine, seconds=0.02):
    """Pace the steps (so concurrent requests share them) and record the request ids each step scheduled."""
    execute, steps = engine.executor.execute_model, []

    def paced(scheduler_output):
        steps.append({s.request_id for s in scheduler_output.scheduled_seqs})
        threading.Event().wait(seconds)
        return execute(scheduler_output)

    engine.executor.execute_model = paced
    return steps


def exploding_when_asked(state):
    """The server's request_params, except that a request whose `user` is "explode" gets ExplodingParams."""
    reference = state.request_params

    class Params:
        @staticmethod
        def to_sampling_params(req, *args):
            params = reference.to_sampling_params(req, *args)
            return ExplodingParams(**vars(params)) if req.user == "explode" else params

    state.request_params = Params


def sse_events(r: httpx.Response) -> list:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_one_requests_failure_in_a_step_fails_it_alone(engine, tokenizer):
    prompts = ["Once upon a time", "The capital of France", "1, 2, 3, 4"]
    body = lambda p, **kw: {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0,  # noqa: E731
                            "ignore_eos": True, **kw}
    with serving(engine, tokenizer, model_name="tiny") as (url, server):
        alone = [httpx.post(f"{url}/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
                 for p in prompts]  # the oracle: each request with nobody else in its steps
        steps = record_steps(engine)
        exploding_when_asked(server.state)

        async def together():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                async def stream_explode():
                    async with http.stream("POST", "/v1/completions",
                                           json=body("Hello", stream=True, user="explode")) as r:
                        return r.status_code, [e async for e in r.aiter_lines() if e.startswith("data: ")]
                calls = [http.post("/v1/completions", json=body(p)) for p in prompts]
                calls += [http.post("/v1/completions", json=body("Hello", user="explode")), stream_explode()]
                return await asyncio.gather(*calls)

        *normal, failed, (stream_status, events) = asyncio.run(together())
        assert [r.json()["choices"][0]["text"] for r in normal] == alone  # the others finish, token for token
        assert "injected failure" in assert_openai_error(failed, 500)["message"]
        assert stream_status == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 500 and "injected failure" in error["message"]
        # they did share steps: a failing request and the others were in one batch
        failing = {rid for s in steps for rid in s if len(s) >= 3}
        assert len(failing) >= 3
        assert httpx.post(f"{url}/v1/completions", json=body(prompts[0]), timeout=60).json()["choices"][0]["text"] \
            == alone[0]  # the server serves on
    assert_pool_whole(engine)


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", "NaN"), ("top_p", "Infinity"),
    ("logit_bias", {"5": "NaN"}), ("repetition_penalty", 1e-300), ("logit_bias", {"5": 1000}), ("n", 10**6),
    ("top_k", -5), ("timeout", "1e400"), ("ttft_slo_ms", "-Infinity")])
def test_every_field_that_reaches_a_tensor_is_bounded_at_the_edge(engine, tokenizer, field, value):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        raw = json.dumps(chat_body(**{field: 0})).replace(f'"{field}": 0',
                                                          f'"{field}": {value if isinstance(value, str) else json.dumps(value)}')
        r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        error = assert_openai_error(r, 400)
        assert error["param"].split(".")[0].split("[")[0] == field, error
    assert_pool_whole(engine)


def test_the_largest_seed_serves(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        for seed in (2**63 - 1, -(2**63)):  # OpenAI's bound, both ends; n = 4 draws with seed + 0..3
            r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(seed=seed, temperature=1, n=4), timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert_pool_whole(engine)
