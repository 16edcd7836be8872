"""Chapter 16 — nanoserve replicas on Ray Serve: the OpenAI API of chapter 08 in front, the routers, the
autoscaler and a replica killed mid-stream. One local Ray (2 logical CPUs) for the module, shut down at
the end; each replica gets one CPU, hence one torch thread, and the tiny random model.

References: chapter 08's one-process server on the same weights (same greedy text, same error bodies),
the replicas' own counters, Ray Serve's own replica count, and the OS's process table."""

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

pytest.importorskip("ray.serve", reason="chapter 16's fleet runs on Ray Serve: pip install 'ray[serve]'")
from nanoserve.bench.routing import autoscaling_trace  # noqa: E402
from nanoserve.cluster.deploy import Autoscaling, serving_fleet, start_ray, wait_for
from nanoserve.cluster.replica import ReplicaSpec
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.runner import serving
from tests.test_ch15_hostile import listening
from tests.test_ch16_routing import solved_16  # noqa: F401  (a fixture: exercise 16 finished, in a copy)
from tests.tiny_model import tiny_llama

TINY = {"vocab_size": 49152, "max_position_embeddings": 1024}
ENGINE = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 4}
HI = [{"role": "user", "content": "Hi"}]
# what a skip for "Ray could not start" tells the reader to do
RAY_REMEDY = ("its agents started too slowly on a loaded machine (Ray's own 15 s limit): rerun when the machine "
              "is idle, or where it has more free cores")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")  # the last: an IPv6 socket bound to IPv4's loopback (Ray's gRPC)


def without_ids(body: dict) -> str:
    """An error body with its request id blanked (each server names its own request)."""
    return re.sub(r"(chat)?cmpl-[0-9a-f]+", "ID", json.dumps(body))


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def spec(step_delay_s: float = 0.0, **kw) -> ReplicaSpec:
    """The tiny model in every replica; with step_delay_s, each step takes at least that long (tests/tiny_model.py)."""
    factory = ("tests.tiny_model:paced_tiny_llama", {**TINY, "delay_s": step_delay_s}) if step_delay_s else \
        ("tests.tiny_model:tiny_llama", TINY)
    return ReplicaSpec(factory=factory[0], factory_kwargs=factory[1], engine_kwargs=ENGINE, model_name="tiny", **kw)


def ray_processes() -> list[psutil.Process]:
    """Ray's processes started from this test process (raylet, GCS, workers, agents)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "ray" in " ".join(p.cmdline()).lower():
                found.append(p)
        except psutil.NoSuchProcess:  # gone (or a zombie, a subclass) while we looked: not left behind
            pass
    return found


@pytest.fixture(scope="module")
def ray_session(smollm2_tokenizer):
    import ray

    try:
        start_ray(num_cpus=2)
    except Exception as e:  # noqa: BLE001 — Ray's own bare Exception when its node agents start too slowly
        if "timed out during startup" not in str(e):
            raise
        pytest.skip(f"Ray could not start its node on this machine (3 tries: {e}); {RAY_REMEDY}")
    try:
        yield smollm2_tokenizer
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        assert wait_for(lambda: not ray_processes(), 120), f"Ray left behind: {ray_processes()}"


def test_two_replicas_answer_like_one_server(ray_session, monkeypatch):
    from functools import partialmethod

    from nanoserve.cluster.metrics import FleetStatLogger

    tokenizer = ray_session
    # the ingress's /metrics leaves out a replica that does not answer within its scrape timeout (2 s): on a loaded
    # machine a replica may take longer, and this test asserts every running replica's series
    monkeypatch.setattr(FleetStatLogger, "__init__", partialmethod(FleetStatLogger.__init__, timeout_s=60))
    engine = LLMEngine(tiny_llama(**TINY), engine_config(**ENGINE), tokenizer)
    greedy = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    too_long = {"model": "tiny", "prompt": "hello " * 2000, "max_tokens": 4}
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        one = openai.OpenAI(base_url=url + "/v1", api_key="none")
        expect_chat = one.chat.completions.create(messages=HI, **greedy).choices[0].message.content
        expect_text = one.completions.create(prompt="Once upon a time", **greedy).choices[0].text
        expect_400 = httpx.post(url + "/v1/completions", json=too_long, timeout=60)
        expect_unknown = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "model": "nope"}, timeout=60)
    with serving_fleet(spec(metrics_compat="vllm"), tokenizer, replicas=2) as (url, fleet):
        assert fleet.num_replicas() == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for _ in range(3):  # some of them on each replica (power of two choices)
            assert client.chat.completions.create(messages=HI, **greedy).choices[0].message.content == expect_chat
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(messages=HI, stream=True, **greedy))
        assert streamed == expect_chat
        assert client.completions.create(prompt="Once upon a time", **greedy).choices[0].text == expect_text
        got = httpx.post(url + "/v1/completions", json=too_long, timeout=60)
        assert (got.status_code, without_ids(got.json())) == (expect_400.status_code, without_ids(expect_400.json()))
        assert expect_400.status_code == 400
        got = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "model": "nope"}, timeout=60)
        assert (got.status_code, got.json()) == (expect_unknown.status_code, expect_unknown.json())
        replicas = httpx.get(url + "/replicas", timeout=60).json()["replicas"]
        assert len(replicas) >= 2
        served = 0
        for r in replicas:
            try:
                text = httpx.get(r["metrics_url"], timeout=60).text
            except httpx.HTTPError:
                continue  # a replica of an earlier deployment
            assert "vllm:num_requests_waiting" in text and "vllm:kv_cache_usage_perc" in text
            served += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("nanoserve:request_success_total"))
        assert served == 5, "every request finished on some replica, counted once"
        # the ingress's own /metrics: its HTTP responses, and each running replica's series labelled by replica
        scrape = httpx.get(url + "/metrics", timeout=30)
        assert scrape.status_code == 200
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in scrape.text.splitlines()
                   if line and not line.startswith("#")}
        # every response the ingress sent: the five completions and the /replicas read are 2xx, the two refusals 4xx
        assert samples['nanoserve:http_responses_total{model_name="tiny",status="2xx"}'] == 6
        assert samples['nanoserve:http_responses_total{model_name="tiny",status="4xx"}'] == 2
        running = fleet.infos()
        for replica in running:
            assert f'nanoserve:num_requests_running{{model_name="tiny",replica="{replica}"}}' in samples
            assert f'vllm:kv_cache_usage_perc{{model_name="tiny",replica="{replica}"}}' in samples
        assert sum(v for k, v in samples.items() if k.startswith("nanoserve:request_success_total{")) == 5


def replica_successes(fleet) -> dict[str, float]:
    """Each running replica's own count of finished requests (its /metrics), by replica id."""
    from nanoserve.cluster.replica import replica_metrics_urls

    running, counts = fleet.infos(), {}
    for replica, url in replica_metrics_urls().items():
        if replica in running:
            text = httpx.get(url, timeout=60).text
            counts[replica] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                  if line.startswith("nanoserve:request_success_total"))
    return counts


def test_student_16_routes_a_fleet_and_both_replicas_serve(ray_session, solved_16):
    """`serve --replicas 2 --student 16`: the router of this process's handle runs the learner's
    power_of_two_choices (exercise 16 finished, in a copy) for every request. Requests go one at a time until
    both replicas have served (idle queues tie, so each draw picks either: at most 20 requests, all on one
    replica with probability 2**-19); each replica's own success counter equals the requests the ingress
    recorded as routed to it."""
    tokenizer = ray_session
    with serving_fleet(spec(), tokenizer, replicas=2, student="16") as (url, fleet):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        sent = 0
        while sent < 20 and len({replica for _, replica in fleet.client.routed}) < 2:
            client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, temperature=0)
            sent += 1
        router = fleet.request_router()
        assert router.policy.routing.__name__ == "student_nanoserve_cluster_routing"
        assert router.student.calls["power_of_two_choices"] >= sent  # a retried call (a slow probe) counts again
        routed = [replica for _, replica in fleet.client.routed]
        successes = replica_successes(fleet)
    assert len(successes) == 2 and all(n >= 1 for n in successes.values()), successes
    assert successes == {replica: routed.count(replica) for replica in successes}, (successes, routed)


def test_prefix_router_keeps_each_system_prompt_on_one_replica(ray_session):
    """Three system prompts, three turns each, one request at a time. The prefix router sends every turn
    of a system prompt where its first turn went; so each repeat finds the blocks the turns share (the
    system prompt and the chat template up to "question "), and the replicas' own counters show exactly
    that: 6 repeats x the shared full blocks, hand-computed from the token ids."""
    tokenizer = ray_session
    systems = [f"You are assistant number {i}. " + "Answer briefly and politely. " * 12 for i in range(3)]
    chats = [[[{"role": "system", "content": s}, {"role": "user", "content": f"question {turn}"}] for s in systems]
             for turn in range(3)]
    with serving_fleet(spec(), tokenizer, replicas=2, router="prefix") as (url, fleet):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for turn in chats:
            for messages in turn:
                client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=messages)
        # a fleet deployed after another in one process must not reuse its cached handle (and router):
        # this module's first test deployed a power-of-two fleet under the same names
        assert type(fleet.request_router().policy).__name__ == "PrefixAffinity"
        where = [replica for _, replica in fleet.client.routed]
        by_system = [set(where[i::3]) for i in range(3)]
        assert all(len(r) == 1 for r in by_system), f"each system prompt stays on one replica: {by_system}"
        decisions = fleet.request_router().decisions  # per call: a retried call (a slow probe) counts again
        assert (decisions["new"], decisions.get("overloaded", 0)) == (3, 0) and decisions["owner"] >= 6, decisions
        infos = fleet.infos()
    assert len(infos) == 2
    prompts = [tokenizer.encode_chat(m) for turn in chats for m in turn]
    bs = ENGINE["block_size"]
    # the full blocks turns 1 and 2 of system prompt i find: those of their common prefix with turn 0
    shared = [common_prefix_len(prompts[i], prompts[3 + i]) // bs for i in range(3)]
    assert min(shared) >= 4  # the system prompt is most of the prompt
    assert sum(i["queried_tokens"] for i in infos.values()) == sum(len(p) for p in prompts)
    assert sum(i["hit_tokens"] for i in infos.values()) == 2 * sum(shared) * bs


def test_autoscaling_follows_a_burst_and_the_idle_after(ray_session):
    """1 -> 2 -> 1 replicas. A closed-loop burst (4 clients, each sending its next long request as soon as
    the last one ends: bench/routing.py's autoscaling_trace) keeps 4 requests in flight, 4 times the target
    of 1 per replica, until Ray Serve runs the second replica; then the clients stop and, idle, it goes back
    to min_replicas. The burst lasts as long as the autoscaler needs (its delays, then the new replica's
    start), never less. `pytest -s` prints the trace: seconds, replicas running and starting, requests in flight."""
    tokenizer = ray_session
    fast = Autoscaling(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5,
                       downscale_delay_s=2, metrics_interval_s=0.5, look_back_period_s=1)
    with serving_fleet(spec(step_delay_s=0.05), tokenizer, replicas=None, autoscaling=fast) as (url, fleet):
        assert fleet.num_replicas() == 1
        # generous limits: a replica's start (a Ray worker importing torch) is slow on a loaded machine
        run = autoscaling_trace(url, fleet, fast, "tiny", clients=4, up_timeout_s=300, down_timeout_s=180)
    trace = run["trace"]
    print("\n".join(f"{t:6.1f} s  {n} running  {s} starting  {q} in flight" for t, n, s, q in trace))
    assert run["scaled_up"], f"(s, running, starting, in flight) during the burst: {trace}"
    assert run["statuses"] and set(run["statuses"]) == {200}
    assert max(q for *_, q in trace) == 4 and trace[-1][3] == 0
    assert run["scaled_down"], "idle: back to min_replicas"


def test_a_replica_killed_mid_stream_fails_its_request_and_is_replaced(ray_session):
    tokenizer = ray_session
    with serving_fleet(spec(step_delay_s=0.1), tokenizer, replicas=2) as (url, fleet):
        pids = {rid: info["pid"] for rid, info in fleet.infos().items()}
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:  # the stream is under way: kill the replica serving it
                    replica = fleet.client.routed[-1][1]
                    os.kill(pids[replica], signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "died" in error["message"] and replica in error["message"], error
        assert wait_for(lambda: fleet.num_replicas() == 2 and replica not in fleet.infos(), 300), \
            "Ray Serve starts a replacement"
        reply = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200


def test_serve_replicas_command_leaves_no_ray_behind(smollm2_tokenizer, tmp_path):
    """The CLI as a user runs it (the real model): a local Ray started and stopped by the command."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "NANOSERVE_API_KEY": "sk-fleet"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # as a user's shell has it: nanoserve.cluster sets it
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--replicas", "2", "--port", "0",
                             "--num-blocks", "64", "--weights", "fp32", "--ray-num-cpus", "2", "--shutdown-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, said = None, []
        for line in proc.stdout:
            said.append(line)
            if line.startswith("nanoserve: serving"):
                url = line.split(" at ")[1].split(" ")[0]
                break
        if url is None and "timed out during startup" in "".join(said):
            pytest.skip(f"Ray could not start its node on this machine; {RAY_REMEDY}")
        assert url, "the server came up:\n" + "".join(said)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-fleet")
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[
            {"role": "user", "content": "What is the capital of France?"}], max_tokens=8, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(c.cmdline()) for c in children)
        # nothing of the fleet listens beyond --host (127.0.0.1): the ingress, Ray's GCS, raylet, agents, workers
        # and the replicas' /metrics, read from the OS's socket table of the server and all its children
        sockets = listening(psutil.Process(proc.pid))
        assert len(sockets) >= 4, sockets
        # the one known exception (chapter 16): Ray Serve's inter-deployment gRPC server, bound to [::]:0 in each
        # replica with no setting for its address; anything else beyond loopback fails here
        # (a Ray worker's process title names the task it runs now: "...LLMReplica.check_health" during a health check)
        beyond = [(ip, name.split(".")[0]) for ip, name in sockets if ip not in LOOPBACK]
        assert sorted(beyond) == [("::", "ray::ServeReplica:nanoserve:LLMReplica")] * 2, beyond
        # /replicas asks for the key like every other route
        assert httpx.get(url + "/replicas").status_code == 401
        replicas = httpx.get(url + "/replicas", headers={"Authorization": "Bearer sk-fleet"}).json()["replicas"]
        assert len(replicas) == 2 and all(r["metrics_url"].startswith("http://127.0.0.1:") for r in replicas)
        # chapter 12's live page shows one engine: a fleet has none such (a 404, not a broken stream)
        assert httpx.get(url + "/engine/events", headers={"Authorization": "Bearer sk-fleet"}).status_code == 404
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_for(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), 120), \
        "no Ray process left after the command exits"
