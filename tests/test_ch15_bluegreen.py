"""Chapter 15 — blue-green model update (nanoserve/server/versions.py): under a continuous client loop on loopback,
POST /admin/reload loads a shadow engine, warms it, switches new requests to it while in-flight ones finish on the
old one, then retires the old one. Checked on objects, never on timing: every response 200 and attributed to exactly
one version (its system_fingerprint, on every chunk of a stream), the old engine's thread gone and the engine object
itself garbage (a weakref to it and to its KV cache dead), a failed load / warm-up leaving the old version serving
with the reason, the admin route's auth. Tiny random-weight engines; the real model once, through the CLI (SIGHUP)."""

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.runner import serving
from tests.tiny_model import tiny_llama

ADMIN = {"Authorization": "Bearer admin-secret"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from nanoserve.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf()


def tiny_engine(tokenizer, step_s=0.0, weights="fp32", **model):
    llama = tiny_llama(vocab_size=49152, max_position_embeddings=1024, **model)
    if weights == "q4":  # as the GGUF gives them: every decoder Linear in Q4_1 blocks, made by the gguf package
        from gguf import GGMLQuantizationType, quantize

        from nanoserve.model.layers import Linear
        from nanoserve.model.quant import quantize_model

        blocks = {name: torch.from_numpy(quantize(m.weight.detach().numpy(), GGMLQuantizationType.Q4_1)
                                         .reshape(m.weight.shape[0], -1, 20))
                  for name, m in llama.named_modules() if isinstance(m, Linear) and name != "lm_head"}
        quantize_model(llama, "q4", blocks)
    engine = LLMEngine(llama, EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16),
                                           scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    if step_s:  # pace the steps like a real model's, so requests are in flight across the switch
        execute = engine.executor.execute_model
        engine.executor.execute_model = lambda out, *a: (time.sleep(step_s), execute(out, *a))[1]
    return engine


def engine_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("nanoserve-engine"))


def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def one_request(http: httpx.Client, stream: bool) -> tuple[int, set[str], int]:
    """(status, the system_fingerprints the response carried, completion tokens)."""
    body = {"messages": HI, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": stream}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        return r.status_code, {r.json().get("system_fingerprint")}, r.json().get("usage", {}).get("completion_tokens", 0)
    prints, tokens, status = set(), 0, 0
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        status = s.status_code
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return 500, prints, tokens
        prints.add(chunk.get("system_fingerprint"))
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return status, prints, tokens


def test_a_reload_under_load_drops_nothing_and_the_old_engine_is_gone(tokenizer):
    loads = []

    def loader(weights, model_file):
        loads.append((weights, model_file))
        return tiny_engine(tokenizer, 0.004, weights)

    blue = tiny_engine(tokenizer, 0.004)
    blue_ref, blue_cache = weakref.ref(blue), weakref.ref(blue.executor.workers[0].model_runner.kv_cache.k_cache[0])
    with serving(blue, tokenizer, model_name="tiny", admin_key="admin-secret", loader=loader,
                 warmup_requests=3) as (url, server):
        del blue  # from here only the server holds it
        assert engine_threads() == ["nanoserve-engine"]
        results, started_after_switch, stop = [], [], threading.Event()
        switched = threading.Event()

        def client(k: int):
            with httpx.Client(base_url=url, timeout=60) as http:
                i = 0
                while not stop.is_set():
                    after = switched.is_set()  # set before the request went out: it must be green's
                    status, prints, tokens = one_request(http, stream=(k + i) % 2 == 0)
                    results.append((status, prints, tokens))
                    if after:
                        started_after_switch.append(prints)
                    i += 1

        clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for c in clients:
            c.start()
        wait_for(lambda: len(results) >= 6, "blue's first answers")
        with httpx.Client(base_url=url, timeout=120) as http:
            r = http.post("/admin/reload", headers=ADMIN, json={"weights": "q4"})
            assert r.status_code == 200, r.text
            switched.set()
            done = r.json()
            assert done["version"] == "nanoserve-q4-2" and done["previous"] == "nanoserve-fp32-1"
            assert done["warmup_requests"] == 3 and loads == [("q4", None)]
            wait_for(lambda: len(started_after_switch) >= 6, "green's answers")
            stop.set()
            for c in clients:
                c.join(60)
            models = http.get("/v1/models").json()["data"]
            assert [m["version"] for m in models] == ["nanoserve-q4-2"]
            metrics = http.get("/metrics").text
        wait_for(lambda: not server.state.versions.retiring, "blue's retirement")

        # 0 failed requests across the switch, each answered by exactly one version, whole
        assert [s for s, _, _ in results if s != 200] == []
        assert all(len(p) == 1 for _, p, _ in results) and all(t == 6 for _, _, t in results)
        versions = [next(iter(p)) for _, p, _ in results]
        assert set(versions) == {"nanoserve-fp32-1", "nanoserve-q4-2"}
        assert all(p == {"nanoserve-q4-2"} for p in started_after_switch)  # new requests went to green
        # the warm-up is not counted in the server's metrics: the finished requests are exactly the clients'
        finished = sum(s.value for f in text_string_to_metric_families(metrics) if f.name == "nanoserve:request_success"
                       for s in f.samples if s.name.endswith("_total"))
        assert finished == len(results)
        # blue is gone: its thread stopped, the engine and its KV cache collected; green serves
        assert engine_threads() == ["nanoserve-engine-nanoserve-q4-2"]
        gc.collect()
        assert blue_ref() is None and blue_cache() is None
        green = server.state.engine.engine
        assert green.block_manager.get_num_free_blocks() == green.block_manager.num_blocks
        layers = [type(m).__name__ for m in green.executor.workers[0].model_runner.model.modules()]
        assert "Q4Linear" in layers and "Linear" not in layers  # green really runs q4 (lm_head: int8)
    assert engine_threads() == []


def test_an_empty_reload_keeps_the_file_and_format_the_server_runs_now(tokenizer):
    """`{}` reloads the current version's file and format, not the start-up ones (SIGHUP's handler, Server.reload,
    calls the same versions.reload() with no field given)."""
    loads = []

    def loader(weights, model_file):
        loads.append((weights, model_file))
        return tiny_engine(tokenizer)

    with serving(tiny_engine(tokenizer), tokenizer, model_name="tiny", admin_key="admin-secret", loader=loader,
                 warmup_requests=0) as (url, server):
        with httpx.Client(base_url=url, timeout=120) as http:
            r = http.post("/admin/reload", headers=ADMIN, json={"weights": "int8", "model_file": "other.gguf"})
            assert r.status_code == 200 and r.json()["version"] == "nanoserve-int8-2", r.text
            r = http.post("/admin/reload", headers=ADMIN, json={})
            assert r.status_code == 200 and r.json()["version"] == "nanoserve-int8-3", r.text
            assert r.json()["model_file"] == "other.gguf"
        wait_for(lambda: not server.state.versions.retiring, "the old versions' retirement")
    assert loads == [("int8", "other.gguf")] * 2


def test_a_failed_load_or_warm_up_leaves_the_old_version_serving(tokenizer):
    release = threading.Event()

    def loader(weights, model_file):
        if weights == "bogus":
            raise ValueError("unknown weights 'bogus'; known: fp32, int8, q4, bf16")
        if model_file == "other-model.gguf":  # loads, but is another model: another vocabulary
            return LLMEngine(tiny_llama(vocab_size=1000, max_position_embeddings=1024),
                             EngineConfig(cache_config=CacheConfig(num_blocks=48, block_size=16)), tokenizer)
        if model_file == "slow.gguf":
            release.wait(30)
        engine = tiny_engine(tokenizer)
        if weights == "int8":  # loads, but every step fails: the warm-up catches it
            engine.executor.execute_model = lambda *a: (_ for _ in ()).throw(RuntimeError("NaN in the logits"))
        return engine

    with serving(tiny_engine(tokenizer), tokenizer, model_name="tiny", admin_key="admin-secret", loader=loader,
                 api_key="client-key") as (url, server), httpx.Client(base_url=url, timeout=60) as http:
        client = {"Authorization": "Bearer client-key"}

        def still_blue():
            assert http.get("/v1/models", headers=client).json()["data"][0]["version"] == "nanoserve-fp32-1"
            r = http.post("/v1/chat/completions", headers=client, json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["system_fingerprint"] == "nanoserve-fp32-1"
            assert engine_threads() == ["nanoserve-engine"]  # no shadow left running

        def error(r, status):
            assert r.status_code == status, r.text
            e = r.json()["error"]
            assert set(e) == {"message", "type", "param", "code"} and e["code"] == status
            return e["message"]

        assert "unknown weights 'bogus'" in error(http.post("/admin/reload", headers=ADMIN, json={"weights": "bogus"}), 400)
        still_blue()
        assert "vocab_size 1000" in error(http.post("/admin/reload", headers=ADMIN,
                                                     json={"model_file": "other-model.gguf"}), 400)
        still_blue()
        message = error(http.post("/admin/reload", headers=ADMIN, json={"weights": "int8", "warmup_requests": 2}), 500)
        assert "warming up nanoserve-int8-2 failed" in message and "NaN in the logits" in message
        assert "nanoserve-fp32-1 is still serving" in message
        still_blue()
        # auth: no key, a client's key, the admin key on the client API
        error(http.post("/admin/reload", json={}), 401)
        error(http.post("/admin/reload", headers=client, json={}), 401)
        error(http.post("/v1/chat/completions", headers=ADMIN, json={"messages": HI, "max_tokens": 1}), 401)
        assert "Unrecognized" in error(http.post("/admin/reload", headers=ADMIN, json={"wieghts": "q4"}), 400)
        # one reload at a time: a second while the first is loading is a 409, and the first still succeeds
        first = {}
        loading = threading.Thread(target=lambda: first.update(r=httpx.post(
            f"{url}/admin/reload", headers=ADMIN, json={"model_file": "slow.gguf"}, timeout=60)))
        loading.start()
        wait_for(lambda: server.state.versions.reloading, "the first reload")
        assert "already under way" in error(http.post("/admin/reload", headers=ADMIN, json={}), 409)
        release.set()
        loading.join(60)
        assert first["r"].status_code == 200 and first["r"].json()["version"] == "nanoserve-fp32-2"
        r = http.post("/v1/completions", headers=client, json={"prompt": "Hi", "max_tokens": 2})
        assert r.json()["system_fingerprint"] == "nanoserve-fp32-2"
    with serving(tiny_engine(tokenizer), tokenizer, model_name="tiny") as (url, _):  # no --admin-key: no route
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN, json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404


def serve_parser():
    from nanoserve.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser, serve


@pytest.mark.parametrize("flags, message", [
    (["--admin-key", "k", "--api-key", "k"], "must differ"),
    (["--admin-key", " "], "empty"),
    (["--admin-key", "k", "-tp", "3"], "tensor-parallel"),
    (["--admin-key", "k", "--warmup-requests", "-1"], "warmup-requests"),
])
def test_the_cli_refuses_a_bad_admin_setup(flags, message):
    parser, serve = serve_parser()
    assert message in serve.check_args(parser.parse_args(["serve", *flags]))


def test_sighup_and_admin_reload_through_the_cli_real_model():
    """The real SmolLM2 through `python -m nanoserve serve`: SIGHUP reloads the file (fp32-2) and the next request
    is answered by it; the CLI's loader refuses an unknown format (400, fp32-2 serving on); SIGTERM drains, exit 0.
    (A switch to q4 under load is the tiny-model test's and `bench bluegreen`'s: a second load here costs ~15 s.)"""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", "0", "--admin-key", "admin-secret",
                             "--kv-cache-mib", "16", "--warmup-requests", "1", "--weights", "fp32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found.group(1)
                break
        assert url, proc.stderr.read()
        with httpx.Client(base_url=url, timeout=300) as http:
            wait_for(lambda: http.get("/health").status_code == 200, "the server", 300)

            def version():
                return http.get("/v1/models").json()["data"][0]["version"]

            assert version() == "nanoserve-fp32-1"
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: version() == "nanoserve-fp32-2", "the SIGHUP reload", 300)
            r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["system_fingerprint"] == "nanoserve-fp32-2"
            r = http.post("/admin/reload", headers=ADMIN, json={"weights": "q5"})  # the CLI's loader refuses it
            assert r.status_code == 400 and "unknown weights 'q5'" in r.json()["error"]["message"], r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "reloaded, serving nanoserve-fp32-2" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
