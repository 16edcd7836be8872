"""`python -m nanoserve serve --disaggregated` (chapter 17): a prefill engine, a decode engine and the proxy in
front of them, started and stopped as one command.

    python -m nanoserve serve --disaggregated --weights fp32 --threads 1 --port 8000

does what chapter 17's three commands do by hand:

    serve --kv-role prefill --port 0 ...   ─┐ two child processes, each its own KV pool, scheduler and --threads
    serve --kv-role decode  --port 0 ...   ─┘ torch threads, on free loopback ports
    the proxy (nanoserve/disagg/proxy.py)     this process, on --host:--port: the one URL clients use

Every flag of `serve` is forwarded to both engines as given (FORWARDED), belongs to this process (OWN), or is
refused with one `error:` line (REFUSED, and what `serve --kv-role` refuses itself), all before any process
starts. The API key travels in the engines' environment, not on their command lines (which `ps` shows). An
engine's warnings and errors reach this terminal prefixed with its role ("decode: ...").

Stopping: Ctrl-C or SIGTERM stops the proxy first (running streams get --shutdown-timeout seconds), then both
engines (SIGTERM: each drains, and the prefill engine frees its staged KV segments in /dev/shm). An engine that
dies stops the proxy and the other engine, and the command ends with one `error:` line, exit 1. The engines run
in sessions of their own: a Ctrl-C in the terminal reaches this process alone, so that order holds.
"""

import argparse
import copy
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from nanoserve.cli import serve

ROLES = ("prefill", "decode")
READY = "nanoserve: serving "  # how `serve` says it is up: "nanoserve: serving MODEL at URL (..."

# serve's flags, each passed to both engines as given: the weights, the pool, the budget, the keys, the limits
FORWARDED = ("model", "served_model_name", "api_key", "api_keys", "request_timeout", "default_max_tokens",
             "metrics_need_key", "max_waiting_requests", "max_body_bytes", "shutdown_timeout", "log_level", "threads",
             "block_size", "num_blocks", "kv_cache_mib", "max_num_seqs", "max_num_batched_tokens",
             "no_chunked_prefill", "no_prefix_caching", "student", "attention_backend", "weights", "kv_cache_dtype",
             "scheduling_policy", "slo_ttft_ms", "slo_tpot_ms", "slo_reject", "metrics_compat", "integer_dot",
             "native_decode")
OWN = ("host", "port", "disaggregated")  # the proxy's (--log-level and --shutdown-timeout serve it too)
EAGER = "each engine runs chapter 17's eager single-process step"
PLAIN_KV = "the KV connector moves plain KV blocks of the base model"
FLEET = "the pair is two engine processes, not a Ray Serve fleet (chapter 16)"
REFUSED = {
    "kv_role": "it gives each engine its role itself", "kv_control_port": "the prefill engine picks a free one",
    "admin_key": "a blue-green reload swaps the engine of one process; restart the pair instead",
    "warmup_requests": "it is --admin-key's, which a pair does not take",
    "rate_limit": "behind the proxy every client is 127.0.0.1, so a per-client limit would be one limit for all",
    "rate_burst": "it is --rate-limit's, which a pair does not take",
    "tensor_parallel_size": EAGER, "compile_mode": EAGER, "speculative": EAGER, "num_speculative_tokens": EAGER,
    "degrade_under_load": EAGER,
    "enable_lora": PLAIN_KV, "lora_modules": PLAIN_KV, "max_loras": PLAIN_KV, "max_lora_rank": PLAIN_KV,
    "max_cpu_loras": PLAIN_KV, "kv_tier_blocks": PLAIN_KV, "kv_tier_path": PLAIN_KV,
    "preemption_mode": "swap needs the KV tier (--kv-tier-blocks), which a pair does not take",
    **dict.fromkeys(["replicas", "ray_address", "router", "replica_cpus", "ray_num_cpus", "min_replicas",
                     "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"], FLEET),
    "kv_events_endpoint": "two engines cannot publish on one endpoint",
    "kv_events_allow_remote": "it is --kv-events-endpoint's, which a pair does not take",
}


def serve_parser() -> argparse.ArgumentParser:
    """`serve`'s own parser: its flags, their spellings and defaults."""
    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    return sub.choices["serve"]


def flags(parser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001 — argparse's list


def check_pair_args(args, parser) -> str | None:
    """The first flag the pair cannot honour, in words, or None: REFUSED's, then whatever `serve --kv-role` would
    refuse in either engine (the engine flags, an int8 pool, a keys file that does not parse, ...)."""
    for action in flags(parser):
        if action.dest in REFUSED and getattr(args, action.dest) != action.default:
            return f"--disaggregated cannot be combined with {action.option_strings[0]}: {REFUSED[action.dest]}"
    for role in ROLES:
        engine = copy.copy(args)  # check_args fills in defaults (the policy, the tenants): on a copy
        engine.kv_role, engine.disaggregated = role, False
        problem = serve.check_args(engine)
        if problem is not None:
            return problem
    return None


def engine_command(args, parser, role: str) -> list[str]:
    """`python -m nanoserve serve --kv-role ROLE` on a free loopback port, with every FORWARDED flag that is not at
    its default (the API key aside: it goes in the environment)."""
    argv = [sys.executable, "-m", "nanoserve", "serve", "--kv-role", role, "--host", "127.0.0.1", "--port", "0"]
    for action in flags(parser):
        value = getattr(args, action.dest)
        if action.dest in FORWARDED and action.dest != "api_key" and value != action.default:
            argv += [action.option_strings[0]] if value is True else [action.option_strings[0], str(value)]
    return argv


def engine_env(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NANOSERVE_API_KEY"}
    return env if args.api_key is None else {**env, "NANOSERVE_API_KEY": args.api_key}


def served_url(line: str) -> str | None:
    """The URL in `serve`'s "nanoserve: serving MODEL at URL (..." line; None for any other line."""
    return line.split(" at ", 1)[1].split()[0] if line.startswith(READY) and " at " in line else None


def read_stdout(proc: subprocess.Popen, on_url) -> None:
    """Read a `serve` process's stdout to its end: on_url(url) at its ready line; the rest (its own banner, which
    names its own port) is dropped. Read it all the same: a full pipe would block the engine."""
    for line in proc.stdout:
        url = served_url(line)
        if url is not None:
            on_url(url)


def forward_stderr(proc: subprocess.Popen, role: str) -> None:
    for line in proc.stderr:
        print(f"{role}: {line}", end="", file=sys.stderr, flush=True)


def exit_status(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def first_dead(engines: dict) -> tuple[str, int] | None:
    """(role, exit code) of an engine that has stopped, or None while both run."""
    for role, proc in engines.items():
        if proc.poll() is not None:
            return role, proc.returncode
    return None


def stop_engines(engines: dict, timeout: float) -> None:
    """SIGTERM to each engine still running; one that has not drained and exited within `timeout` is killed. Only
    the engine itself: its session's resource tracker (multiprocessing's) then unlinks any segment it left."""
    for proc in engines.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in engines.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_pair(args) -> int:
    parser = serve_parser()
    if args.threads is None:  # the machine split in two: one engine's threads must not wait on the other's
        args.threads = max(1, (os.cpu_count() or 2) // 2)
    serving = serve.serving_format(args)  # both engines get the same --weights and --kv-cache-dtype, explicitly
    problem = check_pair_args(args, parser)
    if problem is None:
        sock, problem = serve.listen(args.host, args.port)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    stop = threading.Event()  # a SIGTERM or Ctrl-C before the proxy runs (uvicorn handles them while it does)
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"starting a prefill and a decode engine ({serving}; {args.threads} thread(s) each) ...", flush=True)
    engines, urls, readers = {}, queue.Queue(), []
    try:
        for role in ROLES:
            engines[role] = proc = subprocess.Popen(
                engine_command(args, parser, role), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=engine_env(args), start_new_session=True)
            for target, more in ((read_stdout, lambda url, r=role: urls.put((r, url))), (forward_stderr, role)):
                readers.append(threading.Thread(target=target, args=(proc, more), daemon=True))
                readers[-1].start()
        ready, dead = {}, None
        while len(ready) < len(ROLES) and not stop.is_set() and dead is None:
            try:
                role, url = urls.get(timeout=0.2)
                ready[role] = url
            except queue.Empty:
                dead = first_dead(engines)
        if dead is None and not stop.is_set():
            dead = proxy(args, sock, engines, ready)
    finally:
        stop_engines(engines, args.shutdown_timeout + 30)  # its drain, then closing the engine
        for reader in readers:  # an engine's last words are printed before ours
            reader.join(5)
        sock.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if dead is not None:
        role, code = dead
        when = "while serving" if len(ready) == len(ROLES) else "before the pair was ready"
        print(f"error: the {role} engine (pid {engines[role].pid}) {exit_status(code)} {when}; the pair is stopped",
              file=sys.stderr, flush=True)
        return 2 if code == 2 else 1  # 2: it refused what it was given (say a --model it cannot read)
    print("nanoserve: stopped", flush=True)
    return 0


def proxy(args, sock, engines: dict, urls: dict) -> tuple[str, int] | None:
    """Serve the proxy on `sock` until SIGTERM / Ctrl-C, or until an engine dies: then (its role, its exit code)."""
    import uvicorn

    from nanoserve.disagg.proxy import build_proxy

    server = uvicorn.Server(uvicorn.Config(build_proxy(urls["prefill"], urls["decode"]), log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    dead = []

    def watch():
        while not server.should_exit:
            if (found := first_dead(engines)) is not None:
                dead.append(found)
                server.should_exit = True
            time.sleep(0.2)

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    pids = ", ".join(f"{role} engine pid {engines[role].pid} at {urls[role]}" for role in ROLES)
    print(f"{READY}{args.served_model_name} at {url} (Ctrl-C to stop; {pids}; {args.threads} thread(s) each). "
          f"Try:\n\n{serve.how_to_call(url, args.served_model_name, args.api_key is not None or bool(args.api_keys))}"
          "\n", flush=True)
    threading.Thread(target=watch, name="nanoserve-pair-watch", daemon=True).start()
    server.run(sockets=[sock])  # the socket listened from the start: connections made before this wait for it
    return dead[0] if dead else None
