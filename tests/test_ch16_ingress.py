"""Chapter 16 — the ingress without Ray: chapter 08's app over a ReplicaClient whose "handle" calls
replica_stream on an in-process engine, as a Ray Serve replica would. Checked against chapter 08's own
server on the same weights: the same greedy text (streamed and not), the same 400 body; and a replica that
dies mid-stream (Ray's RayActorError) ends the stream with a clear error, never a hang."""

import asyncio
import json
import re

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="chapter 16's ingress speaks Ray's errors: pip install 'ray[serve]'")
from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402

from nanoserve.cluster.client import ReplicaClient, routing_hashes
from nanoserve.cluster.deploy import Fleet
from nanoserve.cluster.replica import replica_stream
from nanoserve.engine.async_engine import AsyncLLMEngine
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.prefix_cache import block_hashes
from nanoserve.server.api_server import ServerConfig, ServerState
from nanoserve.server.runner import Server, serving
from tests.tiny_model import tiny_llama

HI = [{"role": "user", "content": "Hi"}]


def without_ids(body: dict) -> str:
    """An error body with its request id blanked (each server names its own request)."""
    return re.sub(r"(chat)?cmpl-[0-9a-f]+", "ID", json.dumps(body))


class FakeStream:
    """What `handle.options(stream=True).generate.remote(...)` returns: an async iterator with cancel(). After
    `die_after` items it raises `error()` (default: the replica's actor died)."""

    def __init__(self, gen, die_after: int | None = None, error=ActorDiedError):
        self.gen, self.die_after, self.error, self.n, self.cancelled = gen, die_after, error, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.die_after is not None and self.n >= self.die_after:
            await self.gen.aclose()
            raise self.error()
        self.n += 1
        return await self.gen.__anext__()

    def cancel(self):
        self.cancelled = True
        asyncio.ensure_future(self.gen.aclose())


class FakeHandle:
    def __init__(self, engine: AsyncLLMEngine, die_after: int | None = None, error=ActorDiedError):
        self.engine, self.die_after, self.error, self.calls = engine, die_after, error, []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, request_id, prompt_ids, params, block_hashes=None, **engine_kwargs):
        self.calls.append(block_hashes)
        return FakeStream(replica_stream(self.engine, "replica-x", request_id, prompt_ids, params, **engine_kwargs),
                          self.die_after, self.error)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=49152, max_position_embeddings=1024)


def ingress(tiny, tokenizer, die_after=None, error=ActorDiedError):
    engine = AsyncLLMEngine(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16),
                                                         scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer))
    engine.start()
    info = {"block_size": 16, "max_model_len": engine.max_model_len, "max_seq_len": engine.max_seq_len}
    handle = FakeHandle(engine, die_after, error)
    client = ReplicaClient(handle, info)
    server = Server(ServerState(client, tokenizer, ServerConfig(model_name="tiny")), "127.0.0.1", 0)
    return server, engine, handle, Fleet(handle, client, False)


def test_routing_hashes_are_the_prefix_cache_chain():
    ids = list(range(100, 150))  # 50 tokens: 3 full blocks of 16, the last token never counts
    assert routing_hashes(ids, 16) == block_hashes(ids, 16)[:3]
    assert routing_hashes(ids[:48], 16) == block_hashes(ids, 16)[:2]  # 48 tokens: block 3 ends on the last one
    assert routing_hashes(ids, 16, limit=1) == block_hashes(ids, 16)[:1]


def test_the_ingress_answers_like_chapter_08(tiny, smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    greedy = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    too_long = {"model": "tiny", "prompt": "hello " * 2000, "max_tokens": 4}
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16),
                                          scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        one = openai.OpenAI(base_url=url + "/v1", api_key="none")
        expect = one.chat.completions.create(messages=HI, **greedy).choices[0].message.content
        expect_400 = httpx.post(url + "/v1/completions", json=too_long, timeout=60)
    server, replica_engine, handle, _ = ingress(tiny, tokenizer)
    port = server.start_in_thread()
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert client.chat.completions.create(messages=HI, **greedy).choices[0].message.content == expect
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(messages=HI, stream=True, **greedy))
        assert streamed == expect
        got = httpx.post(url + "/v1/completions", json=too_long, timeout=60)
        assert expect_400.status_code == 400 and (got.status_code, without_ids(got.json())) == (400, without_ids(expect_400.json()))
        chat_ids = tokenizer.encode_chat(HI)
        assert handle.calls[0] == routing_hashes(chat_ids, 16)  # the hashes travel with the request
    finally:
        server.stop()
        replica_engine.shutdown()
    assert replica_engine.engine.scheduler.seqs == {}


def test_a_replica_that_dies_mid_stream_ends_the_stream_with_an_error(tiny, smollm2_tokenizer):
    server, replica_engine, _, fleet = ingress(tiny, smollm2_tokenizer, die_after=3)  # ack + 2 outputs, then dead
    port = server.start_in_thread()
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "replica replica-x died" in lines[-2] and '"code": 500' in lines[-2]
        assert len(lines) == 2 + 2  # the two outputs it sent, the error, [DONE]
        reply = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert reply.status_code == 500 and "died" in reply.json()["error"]["message"]
        assert fleet.client.in_flight == 0
    finally:
        server.stop()
        replica_engine.shutdown()


def replica_traceback() -> RayTaskError:
    """What Ray raises at the ingress when the replica's code raised: its text is the replica's whole traceback."""
    trace = ('Traceback (most recent call last):\n  File "/home/ops/nanoserve/cluster/replica.py", line 88, in generate\n'
             '    raise ValueError("bad state")\nValueError: bad state\n')
    return RayTaskError("LLMReplica.generate", trace, ValueError("bad state\n  File \"/home/ops/x.py\""), pid=4242,
                        ip="10.1.2.3", actor_id="a" * 32)


@pytest.mark.parametrize("die_after", [0, 3])  # before the replica took the request; mid-stream
def test_a_replica_error_reaches_the_client_as_one_line(tiny, smollm2_tokenizer, die_after):
    """Ray's text of a replica's error names files, the actor, its pid and address: the client gets one line in
    OpenAI's error format (a 503 with Retry-After before the request started, an error event in the stream
    after), with the replica's exception type and the first line of its message."""
    assert "/home/ops" in str(replica_traceback()) and len(str(replica_traceback()).splitlines()) > 3
    server, replica_engine, _, fleet = ingress(tiny, smollm2_tokenizer, die_after, replica_traceback)
    port = server.start_in_thread()
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            status, headers = r.status_code, r.headers
            lines = [line for line in r.iter_lines() if line]
        if die_after == 0:
            assert (status, headers["retry-after"]) == (503, "1")
            error = json.loads(lines[0])["error"]
        else:
            assert status == 200 and lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert "ValueError: bad state" in error["message"] and "\n" not in error["message"], error
        for leak in ("/home/ops", "4242", "10.1.2.3", "a" * 32, "Traceback"):
            assert leak not in error["message"], error
        assert fleet.client.in_flight == 0
    finally:
        server.stop()
        replica_engine.shutdown()


def test_the_ingress_metrics_are_its_own_and_each_replicas_labelled():
    """The ingress's /metrics (cluster/metrics.py) over two replicas' real /metrics servers (replica.py's) and one
    that is gone: its own HTTP counts, each replica's series with replica="..." (hand-set values), nothing from
    the dead one, and none of the ingress's own engine series (it runs no engine: they would read 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    from nanoserve.cluster.metrics import FleetStatLogger
    from nanoserve.cluster.replica import _serve_metrics
    from nanoserve.server.metrics import PrometheusStatLogger

    a, b = PrometheusStatLogger("tiny"), PrometheusStatLogger("tiny")
    a.num_requests_running.set(2)
    a.request_success.labels("tiny", "stop").inc(3)
    a.ttft.observe(0.05)
    b.num_requests_waiting.set(1)
    servers = [_serve_metrics(a, "127.0.0.1"), _serve_metrics(b, "127.0.0.1")]
    try:
        urls = {name: f"http://127.0.0.1:{s.server_address[1]}/metrics" for name, s in zip(("ra", "rb"), servers)}
        urls["gone"] = "http://127.0.0.1:9/metrics"  # nothing listens there: a replica that died
        ingress = FleetStatLogger("tiny", lambda: urls, timeout_s=60)  # a loaded machine may answer slowly
        ingress.record_response(200)
        ingress.record_response(404)
        text = ingress.scrape().decode()
    finally:
        for s in servers:
            s.shutdown()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, **labels):
        return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))))

    assert value("nanoserve:http_responses_total", status="2xx") == 1
    assert value("nanoserve:http_responses_total", status="4xx") == 1
    assert value("nanoserve:num_requests_running", replica="ra") == 2
    assert value("nanoserve:num_requests_running", replica="rb") == 0
    assert value("nanoserve:num_requests_waiting", replica="rb") == 1
    assert value("nanoserve:request_success_total", replica="ra", finished_reason="stop") == 3
    assert value("nanoserve:time_to_first_token_seconds_count", replica="ra") == 1
    assert value("nanoserve:time_to_first_token_seconds_count", replica="rb") == 0
    assert value("nanoserve:num_requests_running") is None  # the ingress's own engine gauges are not exported
    assert not any(dict(labels).get("replica") == "gone" for _, labels in samples)
    assert text.count("# TYPE nanoserve:num_requests_running ") == 1  # one family, a sample per replica
