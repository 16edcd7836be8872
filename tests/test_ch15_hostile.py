"""Chapter 15 — tenants that cannot hurt or read each other, attacked as a hostile tenant would on the tiny model:
one request's failure inside a step fails that request alone (the others in the step finish with the text they
get alone), every field that reaches a tensor or a torch.Generator is bounded at the edge, the prefix cache is
keyed by tenant (a second tenant's cached prefix is no hit for the first), a burst cannot overdraw a token quota,
/metrics and the engine view are an operator's, and nothing listens beyond the server's host unasked."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.server.limits import Tenant, TenantLimits
from nanoserve.server.protocol import APIError
from nanoserve.server.runner import serving
from tests.test_ch08_server import assert_openai_error, assert_pool_whole, chat_body
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)


@pytest.fixture
def engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=96, block_size=16),
                                        scheduler_config=SchedulerConfig(max_num_seqs=8)), tokenizer)


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


TENANTS = {"key-a": Tenant("a"), "key-b": Tenant("b"), "key-q": Tenant("q", tokens_per_minute=60),
           "key-ops": Tenant("ops", role="operator")}


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenants_cached_prefix_is_no_hit_for_another(engine, tokenizer):
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 can be cached
    hits = lambda: engine.block_manager.stats.hit_tokens  # noqa: E731
    with serving(engine, tokenizer, model_name="tiny", api_keys=TENANTS) as (url, _):
        def send(key, **kw):
            before = hits()
            r = httpx.post(f"{url}/v1/completions", headers=auth(key), timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw})
            assert r.status_code == 200, r.text
            return hits() - before

        assert send("key-b") == 0  # b fills its cache
        assert send("key-a") == 0  # the same prompt from a: a miss, it cannot learn that b sent it
        assert send("key-a") == 32  # a's own prefix: a hit, both full blocks
        # sharing is explicit: the same cache_salt (vLLM's field), whoever sends it
        assert send("key-a", cache_salt="public-system-prompt") == 0
        assert send("key-b", cache_salt="public-system-prompt") == 32
        assert send("key-b", cache_salt="tenant:a") == 0  # a salt cannot name another tenant's cache
        assert_openai_error(httpx.get(f"{url}/metrics", headers=auth("key-a")), 403)  # the hit counter is not a's
        scrape = httpx.get(f"{url}/metrics", headers=auth("key-ops")).text
        assert 'nanoserve:prefix_cache_hits_total{model_name="tiny"} 64.0' in scrape
    assert_pool_whole(engine)


def test_a_burst_cannot_commit_more_than_the_token_quota(engine, tokenizer):
    # q: 60 tokens a minute (1 a second). Each request may cost 10 (prompt) + n 2 × max_tokens 10 = 30 tokens: of
    # three sent at once, two are admitted (60 reserved), the third is refused before it runs; each admitted one
    # generates all its 20 tokens (ignore_eos), so nothing comes back and 60 tokens are charged in all.
    record_steps(engine)
    with serving(engine, tokenizer, model_name="tiny", api_keys=TENANTS) as (url, _):
        body = {"model": "tiny", "prompt": list(range(2000, 2010)), "max_tokens": 10, "n": 2, "temperature": 0,
                "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth("key-q")) as http:
                return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(3)])

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200, 200, 429]
        scrape = httpx.get(f"{url}/metrics", headers=auth("key-ops")).text
        assert 'nanoserve:tenant_tokens_total{model_name="tiny",tenant="q"} 60.0' in scrape
        assert 'nanoserve:tenant_requests_total{model_name="tiny",outcome="rate_limited",tenant="q"} 1.0' in scrape
    assert_pool_whole(engine)


def test_tenant_limits_reserve_and_refund_by_hand():
    limits = TenantLimits({"k": Tenant("q", tokens_per_minute=60)})  # 60 in the bucket, 1 more each second
    first = limits.reserve("q", 10 + 2 * 10, now=0.0)  # 30 reserved: 30 left
    second = limits.reserve("q", 30, now=0.0)  # 0 left
    with pytest.raises(APIError) as refused:
        limits.reserve("q", 30, now=1.0)  # 1 dripped in: 29 short, so 29 s to wait
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "29"
    first.spend(10, now=1.0), first.spend(4, now=1.0), first.close(now=1.0)  # stopped early: 16 of 30 come back
    second.spend(35, now=1.0)  # 5 past its reservation: charged as they come (1 + 16 - 5 = 12)
    assert limits.tokens["q"].buckets["q"][0] == pytest.approx(12)
    first.close(now=1.0)  # closing twice gives nothing back twice
    assert limits.tokens["q"].buckets["q"][0] == pytest.approx(12)
    assert limits.reserve("q", 10**6, now=100.0).left == 60  # more than the quota: a full bucket, at most


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff there"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content")])
def test_a_lone_surrogate_is_a_400_naming_the_field(engine, tokenizer, path, body, param):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        # json.dumps writes the lone surrogate as the escape "\ud800": valid JSON, not valid Unicode text
        r = httpx.post(url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        error = assert_openai_error(r, 400)
        assert error["param"] == param and "surrogate" in error["message"]
        assert httpx.post(f"{url}/tokenize", json={"prompt": "fine"}).status_code == 200  # serving on
    assert_pool_whole(engine)


def test_json_routes_need_the_json_content_type(engine, tokenizer):
    body = json.dumps(chat_body())
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):  # what a browser sends cross-site
            headers = {} if ctype is None else {"Content-Type": ctype}
            for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
                assert "application/json" in assert_openai_error(
                    httpx.post(url + path, content=body, headers=headers), 415)["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", content=body,
                        headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
        page = httpx.get(f"{url}/engine")
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
    assert_pool_whole(engine)


def test_a_reload_of_any_readable_file_quotes_none_of_it(tmp_path):
    from nanoserve.model.gguf_loader import open_gguf

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET=hunter2\n")
    with pytest.raises(ValueError) as e:
        open_gguf(secret)
    assert str(e.value) == f"{secret} is not a GGUF file"


def watch(url: str, key: str, snaps: list, stop: threading.Event) -> tuple[threading.Thread, threading.Event]:
    """Read /engine/events with `key` (in a thread) until `stop` is set: the status, then the snapshots, land in
    `snaps`. Returns the thread and an Event set once the stream is open (its status read) or failed to open. The
    stream pings each second, so a set `stop` ends the read within a second; no clock decides what is seen."""
    opened = threading.Event()

    def run():
        try:
            with httpx.stream("GET", f"{url}/engine/events", headers=auth(key), timeout=60) as r:
                snaps.append(r.status_code)
                opened.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        snaps.append(json.loads(line[6:]))
                    if stop.is_set():
                        break
        finally:
            opened.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, opened


def until(condition, timeout: float = 60.0) -> None:
    """Wait for `condition` (the asserts after it say whether it came)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def mentioned(snaps) -> set:
    """Every request id, tenant and block owner the snapshots in `snaps` (after its status) name."""
    out = set()
    for s in snaps[1:]:
        out |= {x["id"] for x in s["running"] + s["waiting"] + s["finished"]} | set(s["tenants"])
        out |= set(s["pool"]["owners"])
    return out


def in_lockstep(engine, feed, viewers: list[list]) -> None:
    """From now on each step of `engine` waits (30 s at most) until every viewer has read a snapshot since the step
    before ran, then one throttle interval more, so that the step's own snapshot is sent at once: every viewer
    reads every step's snapshot, however slow the machine."""
    execute, marks = engine.executor.execute_model, [None]

    def paced(scheduler_output, *args):
        if marks[0] is not None:
            deadline = time.monotonic() + 30
            while any(len(v) <= m for v, m in zip(viewers, marks[0])) and time.monotonic() < deadline:
                time.sleep(0.002)
        time.sleep(feed.min_interval * 1.2)
        out = execute(scheduler_output, *args)
        marks[0] = [len(v) for v in viewers]  # before this step's snapshot is sent (after the step returns)
        return out

    engine.executor.execute_model = paced


def test_a_tenant_sees_its_own_requests_and_streams_count_against_its_limits(engine, tokenizer):
    record_steps(engine, 0.02)
    tenants = {**TENANTS, "key-r": Tenant("r", requests_per_second=0.01, burst=2)}
    with serving(engine, tokenizer, model_name="tiny", api_keys=tenants) as (url, server):
        seen_a, seen_a2, seen_ops, seen_r = [], [], [], []
        stop, stop_r = threading.Event(), threading.Event()
        watchers = [watch(url, "key-a", seen_a, stop), watch(url, "key-a", seen_a2, stop),
                    watch(url, "key-ops", seen_ops, stop), watch(url, "key-r", seen_r, stop_r)]
        try:
            for _, opened in watchers:  # every stream open (and counted) before the limits are tried
                opened.wait(60)
            stop_r.set()  # r's stream has taken its token: it may go
            # a has MAX_EVENT_STREAMS (2) open: a third is refused
            assert "streams open" in assert_openai_error(
                httpx.get(f"{url}/engine/events", headers=auth("key-a"), timeout=60), 429)["message"]
            # r's burst is 2 requests and its stream took one: one completion passes, the next is rate-limited
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=auth("key-r"), timeout=60).status_code == 200
            assert "rate limit" in assert_openai_error(
                httpx.post(f"{url}/v1/completions", json=body, headers=auth("key-r"), timeout=60), 429)["message"]

            # b's second request has 2 completions of a 24-token prompt: they share its first block (16 tokens) as
            # long as they run, a block that a must not tell from b's others
            forked = {**body, "prompt": " ".join(["Once upon a time"] * 6), "n": 2}
            # each step of these requests waits until a's and the operator's viewers have read the snapshot of the
            # step before (bounded): a viewer gets the latest snapshot only, and a slow one must not miss the steps
            # where b's fork shares its block
            in_lockstep(engine, server.state.engine.event_feed, [seen_a, seen_ops])

            async def both():
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    return await asyncio.gather(*[http.post("/v1/completions", json=b, headers=auth(k))
                                                  for k, b in (("key-a", body), ("key-b", body), ("key-b", forked))])

            replies = asyncio.run(both())
            ids = [r.json()["id"] for r in replies]
            # the last snapshots (the requests' ends) reach the viewers after the replies: wait for them
            until(lambda: ids[0] in mentioned(seen_a) and set(ids) <= mentioned(seen_ops))
        finally:
            stop.set(), stop_r.set()
            for thread, _ in watchers:
                thread.join()
        assert seen_a[0] == seen_ops[0] == seen_r[0] == 200
        assert ids[0] in mentioned(seen_a) and not set(ids[1:]) & mentioned(seen_a)  # its own, not b's
        assert "other" in mentioned(seen_a)  # b's blocks, unnamed
        assert "shared:2" in mentioned(seen_ops)  # b's fork shared a block while a watched ...
        assert not any(o.startswith("shared:") for o in mentioned(seen_a))  # ... which a saw as "other" too
        assert not any("shared" in s["pool"] for s in seen_a[1:])  # and never who shares what
        assert all(s["prefix"]["hit_tokens"] == 0 and s["prefix"]["hidden"] for s in seen_a[1:])
        assert set(ids) <= mentioned(seen_ops)  # the operator sees everyone
    assert_pool_whole(engine)


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"])
def test_kv_events_wider_than_the_host_are_refused_in_one_line(endpoint):
    r = subprocess.run([sys.executable, "-m", "nanoserve", "serve", "--kv-events-endpoint", endpoint],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "--kv-events-allow-remote" in lines[0] and "token ids" in lines[0]
    assert "loading" not in r.stdout


def listening(proc: psutil.Process) -> list[tuple[str, str]]:
    """(address, process name) of every TCP socket the process and its children listen on."""
    found = []
    for p in [proc] + proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):  # gone: nothing to read; denied: fails
            found += [(c.laddr.ip, " ".join(p.cmdline()).split()[0]) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
    return found


@pytest.mark.slow
def test_serve_with_kv_events_listens_on_loopback_only():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", "0", "--num-blocks", "32",
                             "--max-num-seqs", "2", "--kv-events-endpoint", "tcp://127.0.0.1:*"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        printed = []
        while not any(line.startswith("print(") for line in printed):  # the ready message's last line
            line = proc.stdout.readline()
            assert line, f"serve exited early: {proc.stderr.read()}"
            printed.append(line.rstrip("\n"))
        assert any(line.startswith("KV-cache events") for line in printed)
        addresses = [ip for ip, _ in listening(psutil.Process(proc.pid))]
        assert len(addresses) >= 2 and all(a in ("127.0.0.1", "::1") for a in addresses), addresses  # HTTP + ZMQ
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
