"""Chapter 16 — start a fleet: Ray, Ray Serve, N replicas, chapter 08's HTTP app in front.

    with fleet(ReplicaSpec(), replicas=2, router="prefix") as f:          # a local Ray, stopped after
        f.client                                                          # the ingress's engine (client.py)
    with serving_fleet(ReplicaSpec(), replicas=2) as (url, f):            # + the HTTP server on a free port
        openai.OpenAI(base_url=url + "/v1", api_key="none")...

    python -m nanoserve serve --replicas 2 [--router prefix] [--ray-address auto]
    python -m nanoserve serve --min-replicas 1 --max-replicas 2 --target-ongoing-requests 2 \\
        --upscale-delay-s 2 --downscale-delay-s 10                        # autoscaling

The ingress runs in this process (no Ray Serve HTTP proxy: nanoserve's own server and validation);
the DeploymentHandle in it routes each request to a replica actor, with the policy `router` names
(round robin, power of two choices, prefix affinity: policies.py) on Ray Serve's router interface (router.py).

Autoscaling is Ray Serve's: every replica reports its ongoing requests; when the average over a
look-back window stays above `target_ongoing_requests` for `upscale_delay_s`, the controller adds
replicas (ceil(total ongoing / target)), and below it for `downscale_delay_s` it removes them.
"""

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from nanoserve.cluster import ray_private
from nanoserve.cluster.client import ReplicaClient
from nanoserve.cluster.replica import LLMReplica, ReplicaSpec
from nanoserve.cluster.policies import ROUTERS

APP_NAME = "nanoserve"
LOOPBACK = "127.0.0.1"


@dataclass
class Autoscaling:
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    # How often replicas and handles report their ongoing requests; None: Ray Serve's default, 10 s. Ray 2.60
    # deprecates the field (a DeprecationWarning when set) for RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S
    # and RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S "in a future release", but 2.60 itself still pushes
    # at this field's interval and reads neither variable: only the tests' second-long autoscaler sets it.
    metrics_interval_s: float | None = None

    def config(self) -> dict:
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "initial_replicas": self.min_replicas, "target_ongoing_requests": self.target_ongoing_requests,
                  "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                  "look_back_period_s": self.look_back_period_s}
        if self.metrics_interval_s is not None:
            config["metrics_interval_s"] = self.metrics_interval_s
        return config


@dataclass
class Fleet:
    handle: object
    client: ReplicaClient
    started_ray: bool

    def replica_states(self) -> dict[str, int]:
        """Replicas by state now, from Ray Serve's status: {"RUNNING": 1, "STARTING": 1}."""
        from ray import serve

        return dict(serve.status().applications[APP_NAME].deployments["LLMReplica"].replica_states)

    def num_replicas(self) -> int:
        """Replicas running now (from Ray Serve's status)."""
        return self.replica_states().get("RUNNING", 0)

    def request_router(self):
        """The RequestRouter object this process's handle routes with (a PolicyRouter), or None before the
        first request (ray_private.py: Ray Serve has no public accessor)."""
        return ray_private.request_router(self.handle)

    def infos(self, calls: int = 32) -> dict[str, dict]:
        """`info()` of each running replica, by replica id: calls until as many replicas answered as Ray
        Serve runs (the router spreads the calls at random), at most `calls` calls."""
        out, running = {}, self.num_replicas()
        for _ in range(calls):
            info = self.handle.info.remote().result()
            out[info["replica_id"]] = info
            if len(out) >= running:
                break
        return out


def deployment(spec: ReplicaSpec, replicas: int | None = 2, autoscaling: Autoscaling | None = None,
               router: str = "pow2", num_cpus: float = 1, max_ongoing_requests: int = 16, imbalance: int = 4,
               student: bool | str | list[str] = False):
    """The bound LLMReplica application: a fixed `replicas` count, or `autoscaling`; `router` names the routing
    policy (policies.ROUTERS). student: the router runs the learner's routing decisions (exercise 16) where
    finished."""
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    options = {"ray_actor_options": {"num_cpus": num_cpus}, "max_ongoing_requests": max_ongoing_requests,
               "health_check_period_s": 2, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": 5}
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling.config()
    else:
        options["num_replicas"] = replicas
    from nanoserve.cluster.router import PolicyRouter

    policy_kwargs = {"imbalance": imbalance} if router == "prefix" else {}
    options["request_router_config"] = RequestRouterConfig(
        request_router_class=PolicyRouter,
        request_router_kwargs={"policy": router, "policy_kwargs": policy_kwargs, "student": student},
        request_routing_stats_period_s=1)
    return LLMReplica.options(**options).bind(spec)


def start_ray(address: str | None = None, num_cpus: int | None = None, tries: int = 3) -> None:
    """ray.init: connect to `address`, or start a local Ray with `num_cpus` logical CPUs, on loopback (its GCS,
    raylet and agents; no dashboard; RuntimeError if Ray was set up otherwise before this). On a loaded
    machine the raylet can give up waiting for its agents (Ray's own 15 s limit): the processes that
    attempt started are stopped (by pid) and it tries again."""
    import psutil
    import ray

    if address is None:
        # the replicas import what this process imports: nanoserve's checkout (and, in the tests and the
        # notebook, its tests/ package for the tiny model) must be on their path too, installed or not
        root = str(Path(__file__).resolve().parents[2])
        paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    for attempt in range(tries):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(address=address, num_cpus=num_cpus if address is None else None, include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR")
            break
        except Exception as e:  # noqa: BLE001 — Ray raises a bare Exception for "timed out during startup"
            if address is not None or "timed out during startup" not in str(e) or attempt == tries - 1:
                raise
            for p in psutil.Process().children(recursive=True):
                if p.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
    node = ray.util.get_node_ip_address()
    if address is None and node != LOOPBACK:  # nanoserve/cluster/__init__.py: a local Ray listens on loopback only
        ray.shutdown()
        raise RuntimeError(f"the local Ray took the address {node}, so it would listen beyond loopback: Ray was "
                           "imported before nanoserve.cluster, or RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is set to 1")


def forget_handles(app_name: str = APP_NAME) -> None:
    """Shut down and drop this process's cached DeploymentHandles of `app_name`.

    Ray Serve keeps one handle per (deployment, application) in a process-wide cache, and its router with
    it (request router class and all), and `serve.delete` does not evict it: the next `serve.run` under the
    same names returns the *old* handle. A prefix-router fleet deployed after a power-of-two one in the same
    process then routed with power of two choices (chapter 16, section 3). Ray has no public call for this
    (ray_private.py)."""
    ray_private.forget_cached_handles(app_name)


@contextlib.contextmanager
def fleet(spec: ReplicaSpec, replicas: int | None = 2, autoscaling: Autoscaling | None = None, router: str = "pow2",
          ray_address: str | None = None, num_cpus: int | None = None, replica_cpus: float = 1, **kw):
    """Deploy the replicas (starting a local Ray unless ray_address names a cluster); yields a Fleet; on
    exit deletes the application and, if it started Ray, shuts Ray down (no Ray process is left)."""
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        start_ray(ray_address, num_cpus)
    if ray_address is None:  # a local fleet listens on loopback only: Ray's node (start_ray, cluster/__init__.py)
        # and, here, each replica's /metrics (on a cluster: the node's address, where a scraper reaches it)
        spec = dataclasses.replace(spec, metrics_host=spec.metrics_host or LOOPBACK)
    try:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        app = deployment(spec, replicas, autoscaling, router, replica_cpus, **kw)
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
        info = handle.info.remote().result()
        yield Fleet(handle, ReplicaClient(handle, info), started)
    finally:
        from nanoserve.cluster.replica import forget_replicas

        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
            forget_replicas()
        with contextlib.suppress(Exception):
            forget_handles()
        if started:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


def build_state(f: Fleet, tokenizer, **config):
    """Chapter 08's ServerState around the fleet's client: the same app, validation and errors; its /metrics
    the ingress's HTTP counters and every replica's series (metrics.py); no /engine page (404: it shows one
    engine). A bound on the waiting queue is refused: a fleet's requests wait in Ray Serve's router and in each
    replica, not in one queue here."""
    from nanoserve.cluster.metrics import FleetStatLogger
    from nanoserve.cluster.replica import replica_metrics_urls
    from nanoserve.server.api_server import ServerConfig, ServerState

    config = ServerConfig(**{**config, "engine_view": False})  # chapter 12's page shows one engine: a fleet has n
    if config.max_waiting_requests is not None:
        raise ValueError("max_waiting_requests: a fleet has no one waiting queue to bound")
    return ServerState(f.client, tokenizer, config, FleetStatLogger(config.model_name, replica_metrics_urls))


def add_fleet_routes(app, f: Fleet) -> None:
    """GET /replicas: each replica's id and its own /metrics URL (where a fleet's scraper reads them); it needs the
    API key (with tenants, an operator's) like /metrics."""
    from fastapi import Depends

    from nanoserve.cluster.replica import replica_metrics_urls

    @app.get("/replicas", dependencies=[Depends(app.state.operator_only)])
    async def replicas():
        return {"replicas": [{"replica_id": rid, "metrics_url": url} for rid, url in replica_metrics_urls().items()]}


@contextlib.contextmanager
def serving_fleet(spec: ReplicaSpec, tokenizer=None, model_name: str | None = None, **fleet_kw):
    """A fleet behind nanoserve's HTTP server on a free loopback port: yields (base URL, Fleet)."""
    from nanoserve.server.runner import Server
    from nanoserve.text.tokenizer import Tokenizer

    tokenizer = tokenizer or Tokenizer.from_gguf(spec.model)
    with fleet(spec, **fleet_kw) as f:
        server = Server(build_state(f, tokenizer, model_name=model_name or spec.model_name), "127.0.0.1", 0)
        add_fleet_routes(server.config.app, f)
        port = server.start_in_thread(timeout=60)
        try:
            yield f"http://127.0.0.1:{port}", f
        finally:
            server.stop()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll until predicate() is true; False after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
