"""Chapter 16 — `serve`'s fleet flags: replicas on Ray Serve, the router, autoscaling, vLLM-compatible signals.

    python -m nanoserve serve --replicas 2 [--router prefix]            a local Ray, started and stopped here
    python -m nanoserve serve --replicas 2 --ray-address auto           an existing Ray cluster (`ray start`)
    python -m nanoserve serve --min-replicas 1 --max-replicas 4 --target-ongoing-requests 2
    python -m nanoserve serve --metrics-compat vllm --kv-events-endpoint tcp://127.0.0.1:5557   (one process)
"""

import signal
import sys
import threading

from nanoserve.cluster.policies import ROUTERS  # Ray (deploy.py) is imported only by run_fleet


def add_fleet_args(p) -> None:
    from nanoserve.cli import checks

    g = p.add_argument_group("beyond one server (chapter 16)")
    g.add_argument("--replicas", type=checks.positive_int, default=None,
                   help="run this many engine replicas on Ray Serve behind this server (default: one engine, "
                        "in this process)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto' or host:port) instead of starting a local Ray")
    g.add_argument("--router", choices=ROUTERS, default=None,
                   help="round-robin: in turn; pow2 (default): the shorter queue of two random replicas; prefix: to "
                        "the replica holding the prompt's leading KV blocks, unless it is busy")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (= its torch threads; default 1)")
    g.add_argument("--ray-num-cpus", type=checks.positive_int, default=None,
                   help="CPUs of the local Ray (default: the machine's; not with --ray-address)")
    g.add_argument("--min-replicas", type=checks.positive_int, default=None,
                   help="autoscale from this many replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=checks.positive_int, default=None, help="autoscale up to this many replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target: requests in flight per replica (default 2)")
    g.add_argument("--upscale-delay-s", type=float, default=None,
                   help="load must stay above target this long to add (default 30)")
    g.add_argument("--downscale-delay-s", type=float, default=None,
                   help="and below it this long to remove (default 600)")
    g.add_argument("--metrics-compat", choices=["vllm"], default=None,
                   help="also export vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="publish KV-cache events in vLLM's format (msgpack over ZMQ PUB) here, e.g. "
                        "tcp://127.0.0.1:5557 (one process only; an endpoint wider than --host needs "
                        "--kv-events-allow-remote)")
    g.add_argument("--kv-events-allow-remote", action="store_true",
                   help="let --kv-events-endpoint listen wider than --host (e.g. tcp://*:5557): every subscriber "
                        "then reads the token ids of every tenant's prompts")


def is_fleet(args) -> bool:
    return args.replicas is not None or args.max_replicas is not None or args.ray_address is not None


FLEET_ONLY = ["router", "replica_cpus", "ray_num_cpus"]  # flags that mean something only to a fleet
AUTOSCALING_ONLY = ["target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"]  # ... to an autoscaled one


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_fleet_args(args) -> str | None:
    """None if the fleet flags make sense together, else the one-line reason: a flag the mode cannot honour (a
    fleet flag without a fleet, an autoscaling flag without --max-replicas) is refused, not ignored."""
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    given = [flag(d) for d in FLEET_ONLY if getattr(args, d) is not None]
    if given and not is_fleet(args):
        return f"{given[0]} is for a fleet: give --replicas (or --min-replicas/--max-replicas)"
    given = [flag(d) for d in AUTOSCALING_ONLY if getattr(args, d) is not None]
    if given and args.max_replicas is None:
        return f"{given[0]} is an autoscaling setting: give --min-replicas/--max-replicas"
    if args.ray_num_cpus is not None and args.ray_address is not None:
        return "--ray-num-cpus sizes a local Ray: with --ray-address the cluster has its own CPUs"
    if autoscale and args.replicas is not None:
        return "give --replicas or --min-replicas/--max-replicas (autoscaling), not both"
    if args.min_replicas is not None and args.max_replicas is None:
        return "--min-replicas needs --max-replicas"
    if autoscale and (args.min_replicas or 1) > args.max_replicas:
        return f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}"
    if args.target_ongoing_requests is not None and args.target_ongoing_requests <= 0:
        return f"--target-ongoing-requests must be > 0, got {args.target_ongoing_requests}"
    if min(args.upscale_delay_s or 0, args.downscale_delay_s or 0) < 0:
        return "--upscale-delay-s and --downscale-delay-s must be >= 0"
    if args.replica_cpus is not None and args.replica_cpus <= 0:
        return f"--replica-cpus must be > 0, got {args.replica_cpus}"
    if is_fleet(args) and args.kv_events_endpoint is not None:
        return "--kv-events-endpoint is for one process; with replicas each would need its own endpoint"
    if is_fleet(args) and args.kv_tier_path is not None:
        return ("--kv-tier-path with --replicas would give every replica the same file: leave it out (each replica's "
                "tier then gets a file of its own)")
    if is_fleet(args) and args.tensor_parallel_size > 1:
        return "--tensor-parallel-size with --replicas is not supported: pick one"
    if is_fleet(args) and args.max_waiting_requests is not None:
        # the requests a fleet holds wait in Ray Serve's router (at this ingress) and in each replica's engine: no
        # one count here is chapter 08's waiting queue, and a bound on requests in flight would be another flag
        return ("--max-waiting-requests with --replicas is not supported: the requests a fleet holds wait in Ray "
                "Serve's router and in each replica's queue, which this server cannot count as one")
    return check_kv_events_args(args)


WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}


def kv_events_host(endpoint: str) -> str | None:
    """The address a tcp:// ZMQ endpoint listens on (None: ipc:// or inproc://, this machine only).

        >>> kv_events_host("tcp://*:5557"), kv_events_host("tcp://[::1]:5557"), kv_events_host("ipc:///tmp/kv")
        ('*', '::1', None)
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    host = rest.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def check_kv_events_args(args) -> str | None:
    """A KV event carries the token ids of a prompt's blocks (chapter 16): refused on an address wider than
    --host (a wildcard, or another interface) unless --kv-events-allow-remote says so on purpose."""
    if args.kv_events_endpoint is None:
        if args.kv_events_allow_remote:
            return "--kv-events-allow-remote needs --kv-events-endpoint"
        return None
    host = kv_events_host(args.kv_events_endpoint)
    wider = host is not None and not is_loopback(host) and not (host == args.host or args.host in WILDCARDS)
    if wider and not args.kv_events_allow_remote:
        return (f"--kv-events-endpoint {args.kv_events_endpoint} listens wider than --host {args.host}: KV events "
                f"carry the token ids of every prompt; give --kv-events-allow-remote to mean it")
    return None


def kv_events_warning(args) -> str | None:
    """The warning a KV-events endpoint beyond loopback gets, allowed or not (None on loopback)."""
    host = kv_events_host(args.kv_events_endpoint)
    if host is None or is_loopback(host):
        return None
    return (f"warning: KV events on {args.kv_events_endpoint} carry the token ids of every tenant's prompts; anyone "
            f"who can reach it can read them")


def spec_from_args(args):
    """What every replica builds: `LLM(model, **engine_kwargs)` with the keyword arguments one process would get
    from the same flags (cli/batch.py's engine_kwargs, the tenants' weights and SLO targets included)."""
    from nanoserve.cli.batch import engine_kwargs
    from nanoserve.cluster.replica import ReplicaSpec

    return ReplicaSpec(args.model, engine_kwargs(args, **getattr(args, "tenant_settings", {})),
                       model_name=args.served_model_name, metrics_compat=args.metrics_compat)


def run_fleet(args, sock, config, ready) -> int:
    """Serve chapter 08's app in this process in front of Ray Serve replicas, until SIGTERM / Ctrl-C."""
    from nanoserve.cluster.deploy import Autoscaling, add_fleet_routes, build_state, fleet
    from nanoserve.server.runner import Server
    from nanoserve.text.tokenizer import Tokenizer

    autoscaling = None
    if args.max_replicas is not None:  # Autoscaling's own defaults for the settings not given
        given = {d: getattr(args, d) for d in AUTOSCALING_ONLY if getattr(args, d) is not None}
        autoscaling = Autoscaling(args.min_replicas or 1, args.max_replicas, **given)
    router = args.router or "pow2"
    tokenizer = Tokenizer.from_gguf(args.model)
    print(f"starting {args.replicas or f'{args.min_replicas or 1}..{args.max_replicas}'} replicas on Ray Serve "
          f"(router: {router}) ...", flush=True)
    try:
        with fleet(spec_from_args(args), args.replicas, autoscaling, router, args.ray_address, args.ray_num_cpus,
                   args.replica_cpus or 1.0, student=args.student) as f:
            server = Server(build_state(f, tokenizer, **vars(config)), args.host, args.port, args.shutdown_timeout,
                            args.log_level, on_ready=ready)
            add_fleet_routes(server.config.app, f)
            server.run(sockets=[sock])
            # Ray's own SIGINT handler may be back: Ctrl-C during the teardown must not leave Ray behind
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ConnectionError as e:  # --ray-address that answers nothing
        print(f"error: cannot join the Ray cluster at {args.ray_address}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 — Ray's bare Exception: its node did not come up
        if "timed out during startup" not in str(e):
            raise
        print(f"error: Ray could not start on this machine: {e}", file=sys.stderr)
        return 1
    return 0
