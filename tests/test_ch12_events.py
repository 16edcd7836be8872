"""Chapter 12 — GET /engine/events through httpx, on a real server with a tiny random model (token ids in).

What a viewer receives must be the engine's own story: every step exactly once (as a step record),
every request that finished, owners that are the running requests, and an empty pool once idle; the key
when the server has one; a tenant's streams past its limit refused; and nothing left subscribed when the
viewer goes, nor a stream that holds up a graceful shutdown. (The throttle, at most ~20 snapshots a second, is
tested on a fake clock in test_ch12_event_feed.py: here the steps are paced slower than it, so that every step
gets a snapshot of its own.)
"""

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from nanoserve.engine.config import CacheConfig, EngineConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.model import Llama, LlamaConfig
from nanoserve.server.engine_view import MAX_EVENT_STREAMS
from nanoserve.server.limits import Tenant
from tests.engine_view_server import start_server
from tests.test_ch08_server import assert_openai_error


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


@pytest.fixture
def server(tiny):
    server = start_server(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=24, block_size=4))))
    yield server
    server.stop()


def url(server, path):
    return f"http://127.0.0.1:{server.port}{path}"


def snapshots(response):
    """The data events of an SSE response, parsed (comments skipped)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def complete(server, prompt, max_tokens, ids):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ids.append(httpx.post(url(server, "/v1/completions"), json=body, timeout=120).json()["id"])


def in_lockstep(engine, feed, seen: list[int]) -> None:
    """Each step of `engine` waits until the viewer has read the snapshot of the step before (seen[0]: the last
    step it read), then one throttle interval more: every step gets a snapshot of its own, and none is replaced
    unread, however slow the machine. The burst is then seen step by step by construction, not by timing."""
    execute, done = engine.executor.execute_model, [0]

    def paced(scheduler_output):
        deadline = time.monotonic() + 30  # a viewer that stopped reading fails the test's asserts, not hangs it
        while seen[0] < done[0] and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(feed.min_interval * 1.2)  # the feed's throttle is over by the end of this step
        out = execute(scheduler_output)
        done[0] += 1
        return out

    engine.executor.execute_model = paced


def test_a_burst_seen_step_by_step(server):
    feed = server.state.engine.event_feed
    assert not feed.watched  # nobody connected: the engine builds nothing
    prompts = [[3 + i, 7, 11, 2 * i + 1, 5, 9][: 3 + i] for i in range(4)]  # 3..6 tokens
    ids, snaps, seen = [], [], [0]
    in_lockstep(server.state.engine.engine, feed, seen)
    with httpx.stream("GET", url(server, "/engine/events"), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        stream = snapshots(r)
        first = next(stream)  # on connect: the idle engine, empty pool
        assert first["running"] == first["waiting"] == [] and first["pool"]["num_free"] == 24
        assert feed.watched
        senders = [threading.Thread(target=complete, args=(server, p, 10, ids)) for p in prompts]
        for t in senders:
            t.start()
        for snap in stream:
            snaps.append(snap)
            seen[0] = snap["step"]
            if sum(len(s["finished"]) for s in snaps) == 4 and not snap["running"] and not snap["waiting"]:
                break
        for t in senders:
            t.join()
    steps = [rec for s in snaps for rec in s["steps"]]
    assert all(s["dropped_steps"] == 0 for s in snaps)
    assert [rec[0] for rec in steps] == list(range(1, len(steps) + 1))  # every step once, in order
    # tokens: each prompt prefilled once (no preemption in 24 blocks), 9 decodes each after the first token
    assert sum(rec[2] for rec in steps) == sum(map(len, prompts))
    assert sum(rec[3] for rec in steps) == 4 * 9 and sum(rec[6] for rec in steps) == 4 * 10
    assert sorted(f["id"] for s in snaps for f in s["finished"]) == sorted(ids)
    for s in snaps:
        running = {seq["id"] for seq in s["running"]}
        held = {o for o in s["pool"]["owners"] if o not in ("free", "cached") and not o.startswith("shared:")}
        assert held <= running  # a block is held by a running request, nobody else
    assert sum(1 for s in snaps if s["steps"]) == len(steps)  # one snapshot per step (in_lockstep)
    assert any(s["running"] for s in snaps)
    assert set(snaps[-1]["pool"]["owners"]) <= {"free", "cached"} and snaps[-1]["pool"]["num_free"] == 24
    deadline = time.monotonic() + 60
    while feed.watched and time.monotonic() < deadline:  # the viewer left: its subscription goes with it
        time.sleep(0.05)
    assert not feed.watched


def test_a_page_opened_after_a_burst_gets_its_steps(server):
    """Nobody watched the burst; a viewer that connects afterwards still gets its steps, from the feed's history,
    in its first snapshot: every step once, the tokens of each kind adding up as worked out by hand."""
    feed = server.state.engine.event_feed
    prompts = [[3, 7, 11], [4, 7, 11, 2, 5]]
    ids = []
    for p in prompts:  # one after the other: the steps are 1 prefill + 5 decodes each
        complete(server, p, 6, ids)
    assert not feed.watched
    with httpx.stream("GET", url(server, "/engine/events"), timeout=60) as r:
        first = next(snapshots(r))
    steps = first["steps"]
    assert [rec[0] for rec in steps] == list(range(1, 13)) and first["step"] == 12
    assert [rec[2] for rec in steps] == [3, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0]  # prefill tokens
    assert [rec[3] for rec in steps] == [0, 1, 1, 1, 1, 1] * 2 and all(rec[6] == 1 for rec in steps)
    assert first["running"] == [] and first["finished"] == []  # events are not replayed: only the steps


def test_events_need_the_key_when_there_is_one(tiny):
    server = start_server(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4))), api_key="sekret")
    try:
        r = httpx.get(url(server, "/engine/events"))
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        wrong = httpx.get(url(server, "/engine/events"), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        with httpx.stream("GET", url(server, "/engine/events"), headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status_code == 200 and next(snapshots(r))["step"] == 0
        assert httpx.get(url(server, "/engine")).status_code == 200  # the page itself holds no data
    finally:
        server.stop()


def test_a_tenants_streams_opened_at_once_past_the_limit_get_429(tiny):
    """Three streams of one tenant opened at the same moment: MAX_EVENT_STREAMS (2) stream, the third is refused
    with a 429 in OpenAI's error format (not a 200 with nothing in it), and the server goes on serving: once the
    two close, the tenant streams again and its completions run."""
    assert MAX_EVENT_STREAMS == 2
    server = start_server(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4))),
                          api_keys={"key-a": Tenant("a")})
    key = {"Authorization": "Bearer key-a"}
    try:
        async def open_three():
            answered, go_on = [], asyncio.Event()

            async def one(http):
                async with http.stream("GET", "/engine/events", headers=key) as r:
                    first = None
                    if r.status_code == 200:  # hold the stream open until all three have their answer
                        first = await anext(line async for line in r.aiter_lines() if line.startswith("data: "))
                    else:
                        await r.aread()
                    answered.append(r)
                    if len(answered) == 3:
                        go_on.set()
                    await asyncio.wait_for(go_on.wait(), 30)
                    return r, first

            async with httpx.AsyncClient(base_url=url(server, ""), timeout=30) as http:
                return await asyncio.gather(*[one(http) for _ in range(3)])

        replies = asyncio.run(open_three())
        streamed = [json.loads(first[len("data: "):]) for r, first in replies if r.status_code == 200]
        refused = [r for r, _ in replies if r.status_code != 200]
        assert len(streamed) == 2 and all(snap["step"] == 0 for snap in streamed)
        (r,) = refused
        assert "2 engine event streams open" in assert_openai_error(r, 429)["message"]
        assert r.headers["retry-after"] == "1"
        # both streams closed: their slots are back, the tenant streams again, and requests are served. (The server
        # frees a slot when it has seen its client go, which a loaded machine may do after the next connection
        # comes in: a 429 until then, so try again for a while.)
        deadline = time.monotonic() + 60
        while True:
            with httpx.stream("GET", url(server, "/engine/events"), headers=key, timeout=30) as again:
                if again.status_code != 429 or time.monotonic() > deadline:
                    assert again.status_code == 200 and next(snapshots(again))["step"] == 0
                    break
            time.sleep(0.05)
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        done = httpx.post(url(server, "/v1/completions"), json=body, headers=key, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_page_and_static_files(server):
    page = httpx.get(url(server, "/engine"))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, kind in (("engine.js", "text/javascript"), ("engine.css", "text/css")):
        r = httpx.get(url(server, f"/engine/static/{name}"))
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and f"/engine/static/{name}" in page.text
    missing = httpx.get(url(server, "/engine/static/api_server.py"))
    assert missing.status_code == 404 and "error" in missing.json()
    for text in (page.text, *(httpx.get(url(server, f"/engine/static/{n}")).text for n in ("engine.js", "engine.css"))):
        assert "http://" not in text and "https://" not in text  # nothing fetched from outside: no CDN


def test_an_open_stream_does_not_hold_up_shutdown(server):
    async_engine = server.state.engine  # a stopped server lets its engines go
    with httpx.stream("GET", url(server, "/engine/events"), timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        # the stream ends by itself, as a complete response: httpx raises RemoteProtocolError on one cut off
        # at the drain timeout (which would also have made every shutdown wait that long)
        for _ in lines:
            pass
        assert server.state.draining
        stopper.join()
    assert not async_engine.is_running
