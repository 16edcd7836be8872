"""`python -m nanoserve bench serve`: a load generator for any OpenAI-compatible server (chapter 09).

    python -m nanoserve bench serve --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4 \\
        --max-concurrency 16 --dataset course --goodput ttft:500 tpot:100 --result-json results/serve.json

Arrivals and the open loop are nanoserve/bench/load.py: request i is *scheduled* at the sum of i gamma
gaps (shape `burstiness`, mean 1 / request_rate; `--request-rate inf` sends all at once) and *sent* on that
schedule, not when earlier replies come; `--max-concurrency` caps the requests in flight, like a pool of
that many users, and the time a request waited for the pool is reported apart ("client wait"), so an
overloaded server cannot hide its queue in the load generator's. Each request streams (client.py) and is
summarised by the one metric module (nanoserve/metrics.py). `--student 09` (or a bare `--student`): exercise
09's metrics.py and load.py, each rung where finished (the reference's where not, with a warning naming it).
"""

import asyncio
import datetime
import functools
import importlib
import json
import math
import os
import platform
import sys

PERCENTILE_ROWS = [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                   ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")]
GOODPUT_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}
BURSTINESS = 1.0  # without --burstiness: Poisson arrivals
RANDOM_INPUT_LEN = 128  # without --input-len: the prompt tokens of --dataset random


def register(sub):
    p = sub.add_parser("serve", help="load-test any OpenAI-compatible server: TTFT, TPOT, ITL, E2E, goodput (chapter 09)")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, or inf (all at once)")
    p.add_argument("--burstiness", type=float, default=None,
                   help=f"gamma shape of the arrival gaps (default {BURSTINESS:g} = Poisson); needs a finite --request-rate")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--dataset", default="course", help="'course' (the shipped prompt set), 'random', or a JSONL file")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"prompt tokens of --dataset random (default {RANDOM_INPUT_LEN}); no other dataset takes it")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens of every request (default: each item's own; 128 for random)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens (vLLM's extension)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms, any of ttft:MS tpot:MS e2el:MS; goodput = requests/s meeting all of them")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent (and not counted) before the run, each a prompt of its own (warmup_item)")
    p.add_argument("--result-json", default=None, help="write the summary and per-request figures here")
    p.add_argument("--student", nargs="?", const="09", default=False, metavar="09",
                   help="measure and report with YOUR code (exercises/09-measuring: metrics.py, load.py)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds, metrics.py's names)."""
    slos = {}
    for spec in specs or []:
        name, _, ms = spec.partition(":")
        if name not in GOODPUT_NAMES:
            raise ValueError(f"--goodput {spec!r}: unknown SLO {name!r}; known: {', '.join(GOODPUT_NAMES)}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: expected NAME:MILLISECONDS, e.g. ttft:500") from None
        if not value > 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be > 0 ms")
        slos[GOODPUT_NAMES[name]] = value / 1000
    return slos


def check_args(args) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.burstiness is not None and not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.burstiness is not None and math.isinf(args.request_rate):
        raise ValueError("--burstiness shapes the gaps between arrivals: it needs a finite --request-rate "
                         "(inf sends every request at t = 0)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if args.input_len is not None and args.dataset != "random":
        raise ValueError(f"--input-len is the prompt length of --dataset random, not of --dataset {args.dataset}")
    if args.input_len is not None and args.input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.student and args.student.strip().zfill(2) != "09":
        raise ValueError(f"--student {args.student}: bench serve runs chapter 09's exercises only (--student 09)")
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    if args.dataset not in ("course", "random") and not os.path.isfile(args.dataset):
        raise ValueError(f"--dataset {args.dataset!r}: not 'course', 'random' or an existing JSONL file")


def burstiness(args) -> float:
    return BURSTINESS if args.burstiness is None else args.burstiness


def input_len(args) -> int:
    return RANDOM_INPUT_LEN if args.input_len is None else args.input_len


def load_dataset(args, tokenizer) -> list[dict]:
    from nanoserve.bench import prompts

    if args.dataset == "course":
        items = prompts.course_prompts(args.num_prompts, args.seed)
    elif args.dataset == "random":
        items = prompts.random_prompts(tokenizer, args.num_prompts, input_len(args), args.output_len or 128, args.seed)
    else:
        items = prompts.load_prompts(args.dataset)
        items = [items[i % len(items)] for i in range(args.num_prompts)]  # cycle through the file
    for item in items:
        item["max_tokens"] = args.output_len or item["output_len"] or 128
    return items


async def first_model(client, url: str) -> str:
    """The id of the first model the server at url lists; ValueError when nothing answers there, or no model."""
    import httpx

    try:
        response = await client.get(url.rstrip("/") + "/v1/models")
    except httpx.HTTPError as e:  # nothing listening, a wrong host: the user's --url, not a bug
        raise ValueError(f"cannot reach a server at {url}: {e or type(e).__name__}") from None
    if response.status_code != 200:
        raise ValueError(f"GET {url}/v1/models answered {response.status_code}; give --model")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; give --model")
    return models[0]["id"]


WARMUP_TOKENS = 16


def warmup_item(i: int) -> dict:
    """The i-th warm-up request: a prompt of its own, none of the measured ones (a measured prompt sent first
    would find its blocks in the server's prefix cache when it is measured)."""
    return {"messages": [{"role": "user", "content": f"Warm-up request {i + 1}, not measured: say hello."}]}


async def benchmark(args, items: list[dict], count_tokens, load=None) -> dict:
    """Send every item on its schedule; return the raw results: records, texts, client waits, duration.
    load: the module of arrival_times and open_loop (nanoserve.bench.load, or the learner's)."""
    import httpx
    from tqdm import tqdm

    from nanoserve.bench.client import request_body, send

    load = load or importlib.import_module("nanoserve.bench.load")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10), limits=limits) as client:
        model = args.model or await first_model(client, args.url)
        bodies = [request_body(item, model, args.endpoint, item["max_tokens"], args.ignore_eos) for item in items]
        for i in range(args.warmup):  # the first request pays for connections and lazy set-up: not counted
            body = request_body(warmup_item(i), model, args.endpoint, WARMUP_TOKENS, args.ignore_eos)
            record, _ = await send(client, args.url, body, count_tokens)
            if not record.success:
                raise ValueError(f"the warm-up request failed: {record.error}")
        bar = tqdm(total=len(items), disable=args.no_progress, desc="requests", file=sys.stderr)
        schedule = load.arrival_times(len(items), args.request_rate, burstiness(args), args.seed)
        results, waits, duration = await load.open_loop(
            schedule, lambda i: send(client, args.url, bodies[i], count_tokens), args.max_concurrency,
            on_done=lambda: bar.update(1))
        bar.close()
    records, texts = (list(x) for x in zip(*results))
    return {"model": model, "records": records, "texts": texts, "client_wait": waits, "duration": duration}


def print_summary(summary: dict, client_wait_ms: dict, slos: dict, errors: list[str]) -> None:
    line = lambda label, value: print(f"{label:<40s}{value:>12}")  # noqa: E731
    print("{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="))
    line("Successful requests:", summary["completed"])
    line("Failed requests:", summary["failed"])
    line("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    line("Total input tokens:", summary["total_input_tokens"])
    line("Total generated tokens:", summary["total_output_tokens"])
    line("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    line("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}")
    line("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")
    if slos:
        line("Request goodput (req/s):", f"{summary['goodput']:.2f}")
        print("  SLOs: " + ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in slos.items()))
    for key, title in PERCENTILE_ROWS + [("client_wait", "Client wait (--max-concurrency queue)")]:
        row = client_wait_ms if key == "client_wait" else summary[f"{key}_ms"]
        print("{s:{c}^52}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            value = row[stat]
            line(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {key.upper()} (ms):",
                 "-" if value is None else f"{value:.2f}")
    print("=" * 52)
    for error in errors[:5]:
        print(f"failed: {error}")
    if len(errors) > 5:
        print(f"... and {len(errors) - 5} more failures (all in the result JSON)")


@functools.cache
def model_tokenizer():
    """The embedded model's tokenizer, loaded once per process."""
    from nanoserve.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf()


def command_line(args) -> str:
    flags = [f"--url {args.url}", f"--endpoint {args.endpoint}", f"--num-prompts {args.num_prompts}",
             f"--request-rate {args.request_rate:g}"]
    flags += [f"--burstiness {burstiness(args):g}"] if math.isfinite(args.request_rate) else []
    flags += [f"--dataset {args.dataset}", f"--seed {args.seed}"]
    flags += [f"--max-concurrency {args.max_concurrency}"] if args.max_concurrency else []
    flags += [f"--input-len {input_len(args)}"] if args.dataset == "random" else []
    flags += [f"--output-len {args.output_len}"] if args.output_len else []
    flags += ["--ignore-eos"] if args.ignore_eos else []
    flags += ["--goodput " + " ".join(args.goodput)] if args.goodput else []
    return "python -m nanoserve bench serve " + " ".join(flags)


def measure(args, metrics, load=None) -> dict:
    """Run the benchmark `args` describe; return the result (what --result-json holds). ValueError for bad input."""
    slos = parse_goodput(args.goodput)
    tokenizer = model_tokenizer()  # random prompts, and counting tokens for servers that send no usage
    items = load_dataset(args, tokenizer)
    raw = asyncio.run(benchmark(args, items, lambda text: len(tokenizer.encode(text)), load))
    records = raw["records"]
    for record, item in zip(records, items):
        if record.success and not record.prompt_tokens:  # no usage: the prompt as our template renders it
            record.prompt_tokens = len(tokenizer.encode_chat(item["messages"]))
    latencies = [metrics.request_latencies(r) for r in records]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "url": args.url, "model": raw["model"], "endpoint": args.endpoint, "dataset": args.dataset,
        "command": command_line(args), "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": None if math.isinf(args.request_rate) else burstiness(args),  # inf: no gaps to shape
        "max_concurrency": args.max_concurrency, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "slos_ms": {k: v * 1000 for k, v in slos.items()}, "student_metrics": bool(args.student),
        **metrics.summarize(records, raw["duration"], slos),
        "client_wait_ms": metrics.stats([w * 1000 for w in raw["client_wait"]]),
        "input_lens": [r.prompt_tokens for r in records], "output_lens": [r.output_tokens for r in records],
        "ttfts": [m["ttft"] for m in latencies], "tpots": [m["tpot"] for m in latencies],
        "e2els": [m["e2e"] for m in latencies], "itls": [m["itl"] for m in latencies],
        "errors": [r.error for r in records],
    }


def serve_args(url: str, **options):
    """The arguments of `bench serve --url URL`, defaults filled in, `options` (flag names with _) on top, checked
    as the command checks them (ValueError)."""
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    args = sub.choices["serve"].parse_args(["--url", url])
    unknown = set(options) - set(vars(args))
    if unknown:
        raise TypeError(f"unknown bench serve option(s) {sorted(unknown)}")
    vars(args).update(options)
    check_args(args)
    return args


def run(args):
    try:
        check_args(args)
        parse_goodput(args.goodput)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from nanoserve import student

    # --student 09: the learner's metrics (9.1-9.3), arrivals (9.4) and open loop (9.5) where finished
    code = student.StudentCode(args.student)
    metrics, load = code.module("nanoserve.metrics"), code.module("nanoserve.bench.load")
    if code:
        print(code.describe("bench serve measures and reports"))
    try:
        result = measure(args, metrics, load)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("command: " + command_line(args))
    print(f"server: {args.url}  model: {result['model']}  endpoint: {args.endpoint}  dataset: {args.dataset}  "
          f"rate: {args.request_rate:g}/s  concurrency: {args.max_concurrency or 'unlimited'}")
    print_summary(result, result["client_wait_ms"], parse_goodput(args.goodput), [e for e in result["errors"] if e])
    if args.result_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.result_json}")
    if code:
        print(code.proof())
    return 1 if result["failed"] else 0
