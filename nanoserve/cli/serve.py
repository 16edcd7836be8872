"""`python -m nanoserve serve` (what `make serve` runs): the OpenAI-compatible HTTP server (chapter 08).

    python -m nanoserve serve --host 127.0.0.1 --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

The engine knobs are the ones `batch` and `bench offline` take (nanoserve/cli/batch.py's
add_engine_args). SIGTERM or Ctrl-C drains: running streams get up to --shutdown-timeout seconds,
then the rest are aborted, and the process exits 0. The terminal chat is `python -m nanoserve chat`.

With --admin-key (chapter 15) the model can change without a restart: `POST /admin/reload` with the admin key
and `{"weights": "q4"}` (or `{"model_file": "other.gguf"}`), or SIGHUP (the same file and format, re-read),
loads the next version beside the current one, warms it and switches to it (nanoserve/server/versions.py). The same
key opens chapter 19's sleep mode: `POST /sleep?level=1` (or 2) releases the weights and the KV pool while the server
idles, `POST /wake_up` takes them back (nanoserve/server/sleep_routes.py).

With --disaggregated (chapter 17) this process serves no model: it starts a prefill and a decode engine as two
child processes and runs the proxy in front of them (nanoserve/cli/pair.py).
"""

import argparse
import contextlib
import copy
import os
import socket
import sys

from nanoserve.cli import checks
from nanoserve.cli.batch import add_engine_args, check_engine_args, llm_from_args
from nanoserve.cluster.cli import add_fleet_args, check_fleet_args, is_fleet, kv_events_warning, run_fleet


# a chat request without max_tokens stops here: SmolLM2 at temperature 1 can ramble for the whole context (minutes
# on a CPU); 512 tokens is a long answer for a 135M model, and a client that wants more says so
DEFAULT_MAX_TOKENS = 512


def register(sub):
    p = sub.add_parser("serve", help="serve the model over HTTP, OpenAI-compatible (chapter 08)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default="SmolLM2-135M-Instruct", help="the name clients ask for")
    p.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: $NANOSERVE_API_KEY)")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="tenants: a TOML or JSON file mapping each API key to a tenant name, requests_per_second, "
                        "tokens_per_minute and priority (chapter 08); a request needs one of its keys")
    p.add_argument("--admin-key", default=os.environ.get("NANOSERVE_ADMIN_KEY"),
                   help="enable POST /admin/reload (and SIGHUP) for a blue-green model update (chapter 15) and "
                        "POST /sleep, /wake_up, GET /is_sleeping (chapter 19), with 'Authorization: Bearer KEY'; no "
                        "API key opens them (default: $NANOSERVE_ADMIN_KEY; none: no admin route at all)")
    p.add_argument("--warmup-requests", type=int, default=4, metavar="N",
                   help="with --admin-key: requests a reloaded version must answer before it takes traffic")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="abort a request still unfinished S seconds after it arrived: 408, or an error event in a "
                        "stream (a request's own `timeout` field may ask for less)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="a chat request's max_tokens when it gives none (0: all the context leaves, as in "
                        "vLLM); /v1/models reports it")
    p.add_argument("--metrics-need-key", action="store_true", help="/metrics needs the key too")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many requests wait (default: no bound)")
    p.add_argument("--rate-limit", type=float, default=None, help="requests per second per key or client (429 above)")
    p.add_argument("--rate-burst", type=int, default=10, help="requests a client may send at once under --rate-limit")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running streams may take to finish at shutdown before they are aborted")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    add_lora_args(p)
    add_fleet_args(p)
    p.add_argument("--kv-role", choices=["prefill", "decode"], default=None,
                   help="chapter 17: serve one half of a disaggregated pair (`python -m nanoserve proxy` joins them; "
                        "--disaggregated starts both halves and the proxy)")
    p.add_argument("--kv-control-port", type=int, default=0, metavar="PORT",
                   help="--kv-role prefill: the ZMQ port decode engines release staged KV on (0: a free one)")
    p.add_argument("--disaggregated", action="store_true",
                   help="chapter 17: start a prefill and a decode engine, each its own process, and the proxy in "
                        "front of them on --host:--port, as one command (nanoserve/cli/pair.py)")
    p.add_argument("--threads", type=checks.positive_int, default=None, metavar="N",
                   help="the engine's torch threads (default: torch's, one per core); with --disaggregated, each "
                        "engine's (default: half the cores each)")
    # without --weights / --kv-cache-dtype: the file's own q4 on a bf16 KV pool (serving_format), not the reference
    p.set_defaults(func=run, weights=None, kv_cache_dtype=None)


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its PEFT directory), got {text!r}")
    return name, path


def add_lora_args(p) -> None:
    """Chapter 19: LoRA adapters, vLLM's flags."""
    p.add_argument("--enable-lora", action="store_true",
                   help="LoRA layers on the model's projections (implied by --lora-modules); with --admin-key, "
                        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter load adapters at run time")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                   help="PEFT adapters to serve; a request names one in its `model` field")
    p.add_argument("--max-loras", type=checks.positive_int, default=None, help="adapters in one step (default 4)")
    p.add_argument("--max-lora-rank", type=checks.positive_int, default=None,
                   help="the largest adapter rank served (default 16)")
    p.add_argument("--max-cpu-loras", type=checks.positive_int, default=None,
                   help="adapters kept in memory, slots included (default --max-loras); the others are re-read "
                        "from disk when a request needs them")


def lora_settings(args) -> dict:
    """LLM's LoRA keyword arguments from the flags; {} with LoRA off."""
    if not (args.enable_lora or args.lora_modules):
        return {}
    sizes = {k: v for k, v in (("max_loras", args.max_loras), ("max_lora_rank", args.max_lora_rank),
                                ("max_cpu_loras", args.max_cpu_loras)) if v is not None}
    return {"enable_lora": True, "lora_modules": dict(args.lora_modules), **sizes}


def check_lora_args(args) -> str | None:
    sizes = [f for f, v in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                            ("--max-cpu-loras", args.max_cpu_loras)) if v is not None]
    if not (args.enable_lora or args.lora_modules):
        return f"{sizes[0]} needs --enable-lora or --lora-modules" if sizes else None
    names = [name for name, _ in args.lora_modules]
    if len(set(names)) != len(names) or args.served_model_name in names:
        return "--lora-modules: each adapter needs a name of its own, not the base model's (--served-model-name)"
    if args.tensor_parallel_size > 1 or is_fleet(args) or args.degrade_under_load is not None \
            or args.compile_mode != "eager" or args.speculative == "draft":
        return ("LoRA adapters are served by one eager engine: not with --tensor-parallel-size > 1, --replicas, "
                "--degrade-under-load, --compile-mode or --speculative draft")
    return None


def serving_format(args) -> str:
    """Fill in --weights and --kv-cache-dtype where they were not given, and say what is served.

    The server serves the GGUF's own format (q4, as llama.cpp serves Q4_1 and vLLM's --dtype auto the
    checkpoint's), whose decode step reads 90.5 MiB of weights where float32's reads 513.1 MiB (`info --weights fp32
    q4`), on a bf16 KV pool, half float32's bytes per token. It is not the fastest format everywhere: that depends on
    the CPU and the batch (chapter 10's product table; `bench peers` sets the formats side by side,
    chapters/notes/09-retention-ledger.md).
    --weights fp32 is the float32 reference the course checks against. Where q4 cannot run (tensor parallelism, a
    q4 copy kept under --degrade-under-load) the default is fp32; the Triton backend keeps the model's KV dtype."""
    if args.weights is None:
        args.weights = "fp32" if args.tensor_parallel_size > 1 or args.degrade_under_load is not None else "q4"
        if args.kv_cache_dtype is None and args.weights == "q4" and args.attention_backend != "triton":
            args.kv_cache_dtype = "bf16"
    args.kv_cache_dtype = args.kv_cache_dtype or "auto"
    pool = "the model's" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    step = "eager step" if args.compile_mode == "eager" else f"compiled step ({args.compile_mode})"
    said = f"{args.weights} weights, {pool} KV pool, {step}" + (
        "" if args.weights == "fp32" else " (--weights fp32 is the float32 reference)")
    if args.weights in ("int8", "q4"):  # chapter 10: the large steps' GEMM follows the CPU's bf16 instructions
        from nanoserve.model.quant import LARGE_STEP_DTYPE, default_integer_dot
        from nanoserve.student import parse_selection

        said += ("; large steps in bf16 (this CPU multiplies bf16)" if str(LARGE_STEP_DTYPE) == "torch.bfloat16"
                 else "; large steps in float32 (no bf16 instructions on this CPU)")
        dot = checks.AUTO_ON_OFF[args.integer_dot]
        on = default_integer_dot() if dot is None else dot
        said += ("; small steps in cpu_dot.c's integer products" if on else "; small steps in torch's integer kernels")
        if on and args.weights == "q4" and "10" in parse_selection(args.student):
            said += " (torch's int4 kernel where your exercise 10.2 / 10.3 code reads the blocks)"
        from nanoserve.kernels.cpu_decode import NATIVE_DECODE_MAX_ROWS

        rows = one_token_rows(args, NATIVE_DECODE_MAX_ROWS if on else 1)  # cpu_decode.max_rows, from the flags
        said += f"; {rows}" if rows else ""
    return said


def one_token_rows(args, max_rows: int) -> str:
    """Where q4's steps of one-token rows (decodes, one per sequence: chapter 09's native step) run, in words, as
    LLM will choose from these flags; '' where the weights are not q4.
    max_rows: how many rows a native step takes: cpu_decode.max_rows of the loaded model (bench http's header), or,
    before the load (serve's banner), the same from the flags: NATIVE_DECODE_MAX_ROWS where the q4 layers' small
    steps are cpu_dot.c's (serve has no flag for their crossover), else 1."""
    if args.weights != "q4":
        return ""
    from nanoserve.cli.batch import native_settings
    from nanoserve.kernels.cpu_decode import native_decode_blocker

    # LLM's choice: on refuses where the native step cannot run (check_engine_args), auto turns it off
    choice = getattr(args, "native_decode", "auto")
    blocker = native_decode_blocker(*native_settings(args))
    if choice == "on" or choice == "auto" and not blocker:
        rows = f"up to {max_rows} one-token row{'s' * (max_rows > 1)}"
        return f"decode steps of {rows} in kernels/cpu_decode.c (chapter 09), other steps in the model's forward"
    if choice == "auto":
        return f"decode steps of one-token rows in the model's forward (the native step cannot run: {blocker})"
    return "decode steps of one-token rows in the model's forward (--native-decode off)"


def check_args(args) -> str | None:
    """The first bad argument, in words (before the model loads), or None."""
    # the engine's own flags (add_engine_args) are refused while argparse reads them; these are the server's
    positive = {"--rate-burst": args.rate_burst, "--max-body-bytes": args.max_body_bytes}
    for flag, value in positive.items():
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        return f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}"
    if args.rate_limit is not None and args.rate_limit <= 0:
        return f"--rate-limit must be > 0 requests/s, got {args.rate_limit}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0 s, got {args.shutdown_timeout}"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key (or NANOSERVE_API_KEY) is empty"
    if args.default_max_tokens < 0:
        return f"--default-max-tokens must be >= 0 (0: all the context leaves), got {args.default_max_tokens}"
    if args.request_timeout is not None and args.request_timeout <= 0:
        return f"--request-timeout must be > 0 s, got {args.request_timeout}"
    if args.api_keys is not None:
        from nanoserve.server.limits import load_api_keys

        try:
            args.api_keys = load_api_keys(args.api_keys)
        except ValueError as e:
            return f"--api-keys: {e}"
    from nanoserve.server.limits import scheduling_settings

    try:  # chapter 15: the tenants' weights and SLO targets, for the engine's scheduling policy
        args.tenant_settings = scheduling_settings(args.api_keys)
    except ValueError as e:
        return f"--api-keys: {e}"
    if args.scheduling_policy is None:
        args.scheduling_policy = default_policy(args.api_keys)
    from nanoserve.engine.config import SchedulerConfig

    try:  # a scheduling flag or tenant setting the chosen policy would not read is refused, not dropped
        SchedulerConfig(policy=args.scheduling_policy, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                        slo_reject=args.slo_reject, **args.tenant_settings)
    except ValueError as e:
        return str(e)
    if args.threads is not None and is_fleet(args):
        return "--threads is one process's: a fleet's replicas get --replica-cpus threads each"
    problem = check_engine_args(args) or check_admin_args(args) or check_lora_args(args) or check_kv_role_args(args)
    return problem or check_fleet_args(args)


def check_kv_role_args(args) -> str | None:
    """Chapter 17: --kv-role serves one engine in this process, eager and whole."""
    if args.kv_role is None:
        return "--kv-control-port needs --kv-role prefill" if args.kv_control_port else None
    if not 0 <= args.kv_control_port <= 65535:
        return f"--kv-control-port must be in [0, 65535], got {args.kv_control_port}"
    if args.kv_control_port and args.kv_role != "prefill":
        return "--kv-control-port is the prefill engine's (--kv-role prefill)"
    # the engine would refuse these too (LLMEngine), but only once the model has loaded
    for flag, on in (("--tensor-parallel-size", args.tensor_parallel_size > 1), ("--replicas", is_fleet(args)),
                     ("--admin-key", args.admin_key is not None), ("--speculative", args.speculative is not None),
                     ("--degrade-under-load", args.degrade_under_load is not None),
                     ("--compile-mode", args.compile_mode != "eager"),
                     ("--enable-lora / --lora-modules", args.enable_lora or bool(args.lora_modules)),
                     ("--kv-tier-blocks", args.kv_tier_blocks > 0),
                     (f"--kv-cache-dtype {args.kv_cache_dtype}", args.kv_cache_dtype in ("int8", "fp8"))):
        if on:
            return f"a prefill or decode engine (--kv-role, --disaggregated) cannot be combined with {flag}"
    return None


def kv_transfer_config(args):
    """The KVTransferConfig --kv-role asks for, or None."""
    if args.kv_role is None:
        return None
    from nanoserve.engine.config import CLI_ROLES, KVTransferConfig

    return KVTransferConfig(CLI_ROLES[args.kv_role], kv_control_endpoint=f"tcp://127.0.0.1:{args.kv_control_port or '*'}")


def default_policy(tenants: dict | None) -> str:
    """serve's --scheduling-policy when none is given: with tenants, "fair" (one tenant's flood does not queue
    another's requests behind it: chapter 15's `bench experiment noisy-neighbour`), unless the keys file gives a
    tenant a priority, which only "priority" honours; without tenants, "priority"."""
    if not tenants or any(t.priority != 0 for t in tenants.values()):
        return "priority"
    return "fair"


def check_admin_args(args) -> str | None:
    """--admin-key's refusals: a blue-green reload swaps one engine in this process."""
    if args.admin_key is None:
        return None
    if not args.admin_key.strip():
        return "--admin-key (or NANOSERVE_ADMIN_KEY) is empty"
    if args.admin_key == args.api_key or args.admin_key in (args.api_keys or {}):
        return "--admin-key must differ from every API key: a client's key must not reload the model"
    if args.warmup_requests < 0:
        return f"--warmup-requests must be >= 0, got {args.warmup_requests}"
    if args.tensor_parallel_size > 1 or is_fleet(args) or args.kv_events_endpoint is not None:
        return ("--admin-key reloads the engine of this process or puts it to sleep: not with "
                "--tensor-parallel-size > 1, --replicas or --kv-events-endpoint (a fleet updates by restarting its "
                "replicas one at a time, chapter 16)")
    return None


def how_to_call(url: str, model: str, api_key: bool) -> str:
    """A curl line and a 5-line openai snippet that work as printed."""
    auth = " -H \"Authorization: Bearer $NANOSERVE_API_KEY\"" if api_key else ""
    key = 'os.environ["NANOSERVE_API_KEY"]' if api_key else '"none"'
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}' % model
    return "\n".join([
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "",
        "import os" if api_key else "# or in Python:",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{url}/v1", api_key={key})',
        f'reply = client.chat.completions.create(model="{model}",',
        '                                        messages=[{"role": "user", "content": "Hi"}], max_tokens=64)',
        "print(reply.choices[0].message.content)",
    ])


def reloader(args, tokenizer):
    """POST /admin/reload's loader: the engine these flags describe, with the reload's weights and model file."""

    def load(weights: str, model_file: str | None):
        again = copy.copy(args)
        again.weights, again.model = weights, model_file or args.model
        return llm_from_args(again, tokenizer, **args.tenant_settings, **lora_settings(args)).engine

    return load


def listen(host: str, port: int) -> tuple[socket.socket | None, str | None]:
    """(a listening socket, None), or (None, why not): bound now, a port in use is an error before minutes of model
    loading."""
    try:
        return socket.create_server((host, port)), None
    except OSError as e:
        return None, f"cannot listen on {host}:{port}: {e.strerror or e}"


def run(args):
    from nanoserve.server.api_server import ServerConfig
    from nanoserve.server.metrics import PrometheusStatLogger
    from nanoserve.server.runner import Server, server_state

    if args.disaggregated:  # chapter 17: this process becomes the proxy in front of two engine processes
        from nanoserve.cli.pair import run_pair

        return run_pair(args)
    serving = serving_format(args)
    problem = check_args(args)
    if problem is None:
        sock, problem = listen(args.host, args.port)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    config = ServerConfig(args.served_model_name, args.api_key, args.metrics_need_key, args.max_waiting_requests,
                          args.rate_limit, args.rate_burst, args.max_body_bytes, student=args.student,
                          api_keys=args.api_keys, request_timeout=args.request_timeout,
                          metrics_compat=args.metrics_compat, admin_key=args.admin_key, weights=args.weights,
                          warmup_requests=args.warmup_requests, default_max_tokens=args.default_max_tokens or None)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    def ready():
        key_note = (" Requests need an API key; these lines read it from $NANOSERVE_API_KEY."
                    if args.api_key or args.api_keys else "")
        default = f"at most {args.default_max_tokens} tokens" if args.default_max_tokens else "all the context leaves"
        print(f"nanoserve: serving {args.served_model_name} at {url} (Ctrl-C to stop; a chat reply without "
              f"max_tokens gets {default}: --default-max-tokens).{key_note} Try:\n", flush=True)
        print(how_to_call(url, args.served_model_name, args.api_key is not None or bool(args.api_keys)) + "\n",
              flush=True)
        if is_fleet(args):
            print(f"the fleet's metrics (each replica's, labelled): {url}/metrics; each replica's own: {url}/replicas\n",
                  flush=True)
        else:
            print(f"watch the engine live (chapter 12): {url}/engine\n", flush=True)

    if is_fleet(args):  # chapter 16: the engines are Ray Serve replicas, this process is their ingress
        code = run_fleet(args, sock, config, ready)
        print("nanoserve: stopped (Ray shut down)", flush=True)
        return code
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    print(f"loading the model and a KV pool of {args.num_blocks or str(args.kv_cache_mib) + ' MiB'}: {serving} ...",
          flush=True)
    try:
        llm = llm_from_args(args, **args.tenant_settings, **lora_settings(args),
                            kv_transfer_config=kv_transfer_config(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loader = reloader(args, llm.tokenizer) if args.admin_key else None
    stat_logger = PrometheusStatLogger(args.served_model_name, args.metrics_compat)
    state = server_state(llm.engine, llm.tokenizer, config, stat_logger, loader)  # --student 08: the learner's 8.1-8.4
    publisher = None
    if args.kv_events_endpoint is not None:  # chapter 16: the prefix cache's events, vLLM's wire format
        from nanoserve.kv.kv_events import record_kv_events
        from nanoserve.server.kv_events import KVEventPublisher

        try:
            publisher = KVEventPublisher(record_kv_events(llm.engine.block_manager), args.kv_events_endpoint)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"KV-cache events (vLLM's format): {publisher.endpoint}", flush=True)
        warning = kv_events_warning(args)
        if warning is not None:
            print(warning, file=sys.stderr, flush=True)
    if args.kv_role is not None:  # chapter 17
        control = llm.engine.kv_control_endpoint
        print(f"KV transfer: {args.kv_role} engine" + (f", control endpoint {control}" if control else ""), flush=True)

    # with --tensor-parallel-size the worker processes stop with the server (chapter 11); with --admin-key (one
    # process: nothing to stop) the server's versions keep the only reference to the engine, so a reload frees it
    closing, llm = (llm if loader is None else contextlib.nullcontext()), None
    with closing:
        Server(state, args.host, args.port, args.shutdown_timeout, args.log_level, on_ready=ready).run(sockets=[sock])
    if publisher is not None:
        publisher.close()
    print("nanoserve: stopped", flush=True)
    return 0
