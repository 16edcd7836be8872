"""Chapter 16 — one Ray Serve replica: a whole nanoserve engine (model, KV pool, engine thread) in a Ray actor.

    spec = ReplicaSpec(engine_kwargs={"num_blocks": 256})       # what `LLM(...)` gets, in each replica
    app = LLMReplica.options(num_replicas=2, ray_actor_options={"num_cpus": 1}).bind(spec)
    handle = serve.run(app, name="nanoserve", route_prefix=None)

A replica holds its own KV pool, so a prefix cached in one replica is no use to another: that is why
the router matters (router.py). The ingress tokenizes and calls `generate`, a streaming method:

    handle.options(stream=True).generate.remote(request_id, prompt_ids, params, block_hashes=[...])
      -> ("added", replica id)  or  ("refused", why)          first: did the engine take it?
      -> RequestOutput, RequestOutput, ...                    then one per step, as AsyncLLMEngine yields them

Torch gets as many threads as Ray gave the replica CPUs (`num_cpus`), so two replicas on one machine do
not fight over the same cores. Each replica serves its own Prometheus /metrics on a free port of its
node, as every pod of a fleet does; the URLs are listed by `replica_metrics_urls()`.
"""

import importlib
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ray import serve

from nanoserve.cluster import ray_private

KV_NAMESPACE = b"nanoserve"  # Ray's key-value store (ray_private.py): where replicas announce their /metrics URL


@dataclass
class ReplicaSpec:
    """How a replica builds its engine: `LLM(model, **engine_kwargs)`, where model is None (the embedded
    GGUF), a GGUF path, or `factory` ("module:function", called with factory_kwargs: tests' tiny model)."""
    model: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    factory: str | None = None
    factory_kwargs: dict = field(default_factory=dict)
    model_name: str = "SmolLM2-135M-Instruct"
    metrics_compat: str | None = None
    # where the replica's /metrics listens: None = the Ray node's address (a cluster's scraper reaches it there);
    # a local fleet (one machine, its own Ray) keeps it on loopback
    metrics_host: str | None = None

    def build_llm(self):
        from nanoserve.llm import LLM

        model = self.model
        if self.factory is not None:
            module, fn = self.factory.split(":")
            model = getattr(importlib.import_module(module), fn)(**self.factory_kwargs)
        return LLM(model, **self.engine_kwargs)


def assigned_cpus() -> int:
    """The CPUs Ray reserved for this actor (at least 1): the torch threads it may use."""
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


@serve.deployment
class LLMReplica:
    def __init__(self, spec: ReplicaSpec):
        import torch

        from nanoserve.engine.async_engine import AsyncLLMEngine
        from nanoserve.server.metrics import PrometheusStatLogger

        torch.set_num_threads(assigned_cpus())
        self.llm = spec.build_llm()
        self.stat_logger = PrometheusStatLogger(spec.model_name, spec.metrics_compat)
        self.engine = AsyncLLMEngine(self.llm.engine, self.stat_logger)
        self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics_server = _serve_metrics(self.stat_logger, spec.metrics_host)
        self.metrics_url = f"http://{self.metrics_server.server_address[0]}:{self.metrics_server.server_address[1]}/metrics"
        _announce(self.replica_id, self.metrics_url)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params,
                       block_hashes: list[int] | None = None, **engine_kwargs):
        """The request's stream (see replica_stream). block_hashes is for the router (it reads them from
        the request); the engine hashes for itself. engine_kwargs: AsyncLLMEngine.add_request's priority,
        tenant, slo, speculative."""
        async for item in replica_stream(self.engine, self.replica_id, request_id, prompt_token_ids, sampling_params,
                                         **engine_kwargs):
            yield item

    def info(self) -> dict:
        """Limits the ingress validates against, and this replica's counters (the routing experiment)."""
        engine, stats = self.llm.engine, self.llm.engine.block_manager.stats
        return {"replica_id": self.replica_id, "pid": os.getpid(), "metrics_url": self.metrics_url,
                "max_model_len": engine.max_model_len, "max_seq_len": engine.max_seq_len,
                "block_size": engine.block_manager.block_size,
                "queried_tokens": stats.queried_tokens, "hit_tokens": stats.hit_tokens}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)
        if getattr(self, "metrics_server", None) is not None:
            self.metrics_server.shutdown()
        if getattr(self, "llm", None) is not None:
            self.llm.close()


async def replica_stream(engine, replica_id: str, request_id: str, prompt_token_ids: list[int], sampling_params,
                         **engine_kwargs):
    """("added", replica id) or ("refused", message), then the request's RequestOutputs from `engine`
    (an AsyncLLMEngine). A cancelled call (the client went away) aborts the request (chapter 08)."""
    try:
        outputs = await engine.add_request(request_id, prompt_token_ids, sampling_params, **engine_kwargs)
    except ValueError as e:
        yield ("refused", str(e))
        return
    yield ("added", replica_id)
    async for out in outputs:
        yield out


def _serve_metrics(stat_logger, host: str | None = None) -> ThreadingHTTPServer:
    """GET /metrics of this replica on a free port of `host` (None: the Ray node's address); a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = stat_logger.scrape()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    import ray

    server = ThreadingHTTPServer((host or ray.util.get_node_ip_address(), 0), Handler)
    threading.Thread(target=server.serve_forever, name="nanoserve-replica-metrics", daemon=True).start()
    return server


def _announce(replica_id: str, url: str) -> None:
    ray_private.kv_put(f"metrics/{replica_id}", url, KV_NAMESPACE)


def forget_replicas() -> None:
    """Drop every announced URL (the application is being deleted)."""
    ray_private.kv_delete_prefix(b"metrics/", KV_NAMESPACE)


def replica_metrics_urls() -> dict[str, str]:
    """replica id -> its /metrics URL, for every replica of this application that announced one (a replica
    that died stays listed: a scraper skips the URLs that do not answer)."""
    return {k.decode().split("/", 1)[1]: v.decode() for k, v in ray_private.kv_items(b"metrics/", KV_NAMESPACE).items()}
