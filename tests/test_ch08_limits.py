"""Chapter 08 — limits nobody can dodge: the rate limit keys on what the server verified (rotating made-up
`Authorization` headers buys nothing), the bucket table stays bounded under 100 000 clients, tenants from
--api-keys get their own buckets, token quotas and priority (a flood from one does not starve another),
timeouts abort (408, or an error event then [DONE] in a stream) and free the blocks, a trickling body is
cut without holding up anyone else, and after shutdown begins a client gets a documented answer."""

import asyncio
import json
import socket
import sys
import threading
import time
import tracemalloc

import httpx
import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.limits import Tenant, load_api_keys
from nanoserve.server.runner import serving
from nanoserve.student import implementation
from tests.test_ch08_server import assert_openai_error, assert_pool_whole, chat_body, slow_steps
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)

# a's refill is slow (one request every 20 s): its flood of 30 requests may take seconds to arrive on a loaded
# machine, and must still find at most its burst and one refill
TENANTS = {"key-a": Tenant("a", requests_per_second=0.05, burst=3, priority=1),
           "key-b": Tenant("b", requests_per_second=50, burst=50, priority=0),
           "key-q": Tenant("q", tokens_per_minute=20), "key-ops": Tenant("ops", role="operator")}


@pytest.fixture
def engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=16),
                                        scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)


def TokenBucketLimiter(*args, **kwargs):  # noqa: N802 — the graded class: the learner's under make grade
    return implementation("nanoserve.server.limits").TokenBucketLimiter(*args, **kwargs)


@pytest.mark.exercise("8.4")
def test_token_bucket_worked_example():
    limiter = TokenBucketLimiter(rate=2, burst=3)
    assert [limiter.try_acquire("k", now=0.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]
    assert limiter.try_acquire("k", now=0.25) == pytest.approx(0.25)  # half a token dripped in: 0.25 s to go
    assert limiter.try_acquire("k", now=0.5) == 0.0  # one whole token: taken
    assert limiter.try_acquire("other", now=0.5) == 0.0  # another key, another (full) bucket
    assert limiter.try_acquire("k", now=100.0, cost=3) == 0.0  # refilled, but never beyond the burst of 3 ...
    assert limiter.try_acquire("k", now=100.0) == pytest.approx(0.5)  # ... so the next one waits
    assert limiter.try_acquire("k", now=101.0, cost=2.5) == pytest.approx(0.25)  # 2 there, 0.5 more at 2/s
    assert limiter.try_acquire("k", now=101.0) == 0.0  # a refusal took nothing: 2 still there


@pytest.mark.exercise("8.4")
def test_buckets_expire_and_the_table_stays_bounded():
    limiter = TokenBucketLimiter(rate=10, burst=2, max_keys=1000)
    # what the limiter's code and this test allocate, not what another thread of this process (a server or a
    # publisher a test before left running) allocates meanwhile: traced memory is the whole process's
    # (the files of the limiter's methods: the reference's, and a learner's module, which is not in sys.modules)
    code = {f.__code__.co_filename for cls in type(limiter).__mro__ for f in vars(cls).values() if hasattr(f, "__code__")}
    here = [tracemalloc.Filter(True, path) for path in code | {__file__}]
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(here)
    for i in range(100_000):  # 100 000 distinct clients, one request each, 1 ms apart
        assert limiter.try_acquire(f"client-{i}", now=i / 1000) == 0.0
    grown = sum(d.size_diff for d in tracemalloc.take_snapshot().filter_traces(here).compare_to(before, "filename"))
    tracemalloc.stop()
    # a bucket is full again 0.1 s after its use (the one token it spent, back at 10 a second): only the last
    # ~100 clients still have one (101: the client of 0.1 s ago may be a float's width short of full)
    assert len(limiter.buckets) <= 101 and grown < 1 << 20
    crowded = TokenBucketLimiter(rate=0.001, burst=2, max_keys=1000)  # nothing refills: the bound does the work
    for i in range(100_000):
        crowded.try_acquire(f"client-{i}", now=0.0)
    assert len(crowded.buckets) == 1000
    # expiry never gives a client more than its bucket: a spent bucket is kept until it has refilled
    limiter.try_acquire("x", now=200.0), limiter.try_acquire("x", now=200.0)
    assert limiter.try_acquire("x", now=200.0) == pytest.approx(0.1)


def test_rotating_fake_authorization_headers_do_not_escape_the_rate_limit(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", rate_limit=0.1, rate_burst=2) as (url, _):
        codes = [httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer made-up-{i}"}).status_code
                 for i in range(5)]
        assert codes == [200, 200, 429, 429, 429]  # one client address, one bucket


def test_api_keys_file_toml_and_json(tmp_path):
    toml = tmp_path / "keys.toml"
    toml.write_text('[keys."sk-1"]\ntenant = "team-a"\nrequests_per_second = 5\ntokens_per_minute = 100\n'
                    'priority = 1\n')
    assert load_api_keys(toml) == {"sk-1": Tenant("team-a", 5, 10, 100, 1)}
    js = tmp_path / "keys.json"
    js.write_text(json.dumps({"keys": {"sk-2": {"tenant": "b"}}}))
    assert load_api_keys(js) == {"sk-2": Tenant("b")}
    js.write_text(json.dumps({"keys": {"sk-2": {"tenant": "b", "requests_per_second": -1}}}))
    with pytest.raises(ValueError, match="requests_per_second"):
        load_api_keys(js)


def test_a_tenants_flood_does_not_starve_another(engine, tokenizer):
    slow_steps(engine, 0.005)
    with serving(engine, tokenizer, model_name="tiny", api_keys=TENANTS) as (url, server):
        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                def ask(key):
                    return http.post("/v1/chat/completions", json=chat_body(max_tokens=6, ignore_eos=True),
                                     headers={"Authorization": f"Bearer {key}"})
                flood = [asyncio.ensure_future(ask("key-a")) for _ in range(30)]
                await asyncio.sleep(0.05)
                b = await asyncio.gather(*[ask("key-b") for _ in range(4)])
                return await asyncio.gather(*flood), b

        flood, b = asyncio.run(run())
        assert [r.status_code for r in b] == [200] * 4  # B is served in full
        codes = [r.status_code for r in flood]
        assert codes.count(200) <= 4 and codes.count(429) >= 26  # A gets its burst (and a refill at most), no more
        assert all(int(r.headers["retry-after"]) >= 1 for r in flood if r.status_code == 429)
        assert_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-c"}), 401)
        assert_openai_error(httpx.get(f"{url}/metrics"), 401)  # with tenants, the metrics are an operator's
        assert_openai_error(httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer key-b"}), 403)
        scrape = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer key-ops"}).text
        assert 'nanoserve:tenant_requests_total{model_name="tiny",outcome="admitted",tenant="b"} 4.0' in scrape
        assert 'outcome="rate_limited",tenant="a"' in scrape
    assert_pool_whole(engine)


def test_a_spent_token_quota_is_429_until_it_refills(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", api_keys=TENANTS) as (url, _):
        q = {"Authorization": "Bearer key-q"}  # 20 tokens a minute; one request's prompt + 20 tokens spend it
        first = httpx.post(f"{url}/v1/completions", headers=q, json={"prompt": "Once upon a time", "max_tokens": 20,
                                                                      "ignore_eos": True, "temperature": 0}, timeout=60)
        assert first.status_code == 200
        spent = httpx.post(f"{url}/v1/completions", headers=q, json={"prompt": "x", "max_tokens": 1})
        assert "tokens per minute" in assert_openai_error(spent, 429)["message"]
        assert int(spent.headers["retry-after"]) >= 1
    assert_pool_whole(engine)


def test_timeouts_abort_and_free_the_blocks(engine, tokenizer):
    slow_steps(engine, 0.05)
    with serving(engine, tokenizer, model_name="tiny", request_timeout=30) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=200, ignore_eos=True, timeout=0.3))
        assert "timeout" in assert_openai_error(r, 408)["message"]
        assert_pool_whole(engine)
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=200, ignore_eos=True, timeout=0.3, stream=True)) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 408
        assert_pool_whole(engine)
        # past its deadline before the stream even asked for a token: still aborted (the soak found this leak)
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=200, ignore_eos=True, timeout=0.001, stream=True)) as s:
            assert list(s.iter_lines())[-2] == "data: [DONE]"
    assert_pool_whole(engine)
    with serving(engine, tokenizer, model_name="tiny", request_timeout=0.3) as (url, _):  # the server's own
        assert_openai_error(httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 200,
                                                                       "ignore_eos": True}), 408)
    assert_pool_whole(engine)


def test_a_trickling_body_is_cut_and_holds_up_nobody(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", body_timeout=1.0) as (url, server):
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            # meanwhile another client is served at once
            assert httpx.post(f"{url}/v1/chat/completions", json=chat_body(), timeout=60).status_code == 200
            slow.settimeout(60)  # the 408 may be slow to come on a loaded machine
            answer = b""
            for _ in range(20):  # one byte every 0.1 s until the server cuts us
                try:
                    slow.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.1)
            while b"\r\n\r\n" not in answer:
                chunk = slow.recv(4096)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_after_sigterm_a_new_connection_gets_503_while_streams_drain(engine, tokenizer):
    """The socket keeps listening while the running requests drain, so a connection opened after SIGTERM
    gets 503 + Retry-After (and /health 503), not a refused connection; the running stream finishes."""
    slow_steps(engine, 0.05)
    # from its 3rd step on, the running stream waits (60 s at most) until the new connection was answered: its
    # 40 tokens cannot all be done, and the server gone, before the checks below, however slow the machine
    execute, steps, checked = engine.executor.execute_model, [0], threading.Event()

    def held(scheduler_output):
        steps[0] += 1
        if steps[0] >= 3:
            checked.wait(60)
        return execute(scheduler_output)

    engine.executor.execute_model = held
    with serving(engine, tokenizer, model_name="tiny", shutdown_timeout=60) as (url, server):
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens=40, ignore_eos=True, stream=True), timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            server.should_exit = True  # what SIGTERM sets
            deadline = time.monotonic() + 60
            while not server.state.draining and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                with httpx.Client(base_url=url, timeout=60) as fresh:  # a connection opened after SIGTERM
                    r = fresh.post("/v1/chat/completions", json=chat_body())
                    assert_openai_error(r, 503)
                    assert r.headers["retry-after"] == "1"
                    assert fresh.get("/health").status_code == 503
            finally:
                checked.set()
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and len(rest) >= 40
    assert_pool_whole(engine)


def test_a_client_gone_before_its_first_byte_is_aborted(engine, tokenizer):
    slow_steps(engine, 0.2)
    with serving(engine, tokenizer, model_name="tiny") as (url, server):
        body = json.dumps(chat_body(max_tokens=50, ignore_eos=True, stream=True)).encode()
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", server.port)) as c:
                c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                deadline = time.monotonic() + 60  # until it is admitted, then hang up before reading a byte
                while not engine.scheduler.seqs and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert engine.scheduler.seqs
            body = body.replace(b'"stream": true', b'"stream": false')
            assert_pool_whole(engine)
