"""`python -m nanoserve bench bluegreen`: what a blue-green model update costs under load (chapter 15).

SmolLM2 is served (blue, --from weights) in this process with --admin-key's reload on; --clients streaming
chat clients on loopback send request after request (a closed loop: each sends its next when its last is done,
bench/client.py's `send`). After --before-s seconds, POST /admin/reload {"weights": --to} loads green beside
blue (in a thread), warms it with --warmup-requests requests and switches; blue retires when its last request is
done. Requests are grouped by when they started:

  before   before the reload began
  during   while green loaded and warmed up (blue serving, the load competing with it for the CPU)
  after    after the switch (green serving)

Per phase: requests, failed, TTFT p50 / p99. Memory: the process' resident set (VmRSS, sampled every 20 ms)
before the reload, its peak while both versions were loaded, and after blue retired. Timings on a shared machine
are noisy: read the ratios within one run.
"""

import asyncio
import os
import threading
import time
import weakref

import torch

from nanoserve.cli.checks import positive_int, weight_format
from nanoserve.metrics import percentile

PHASES = ("before", "during", "after")


def register(sub):
    p = sub.add_parser("bluegreen", help="a blue-green model update under load: TTFT before / during / after, "
                                         "peak memory (chapter 15)")
    p.add_argument("--from", dest="from_weights", default="fp32", type=weight_format, help="blue's weights (fp32, int8, q4)")
    p.add_argument("--to", dest="to_weights", default="q4", type=weight_format, help="green's weights")
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="greedy output tokens per request (EOS ignored)")
    p.add_argument("--before-s", type=float, default=20.0, help="seconds of load before the reload")
    p.add_argument("--after-s", type=float, default=10.0, help="seconds of load after blue retired")
    p.add_argument("--warmup-requests", type=int, default=4, help="requests green answers before the switch")
    p.add_argument("--kv-cache-mib", type=positive_int, default=64, help="each version's KV pool")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def rss_mib() -> float:
    """This process' resident set now (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class RSSSampler:
    """VmRSS every `every` seconds in a thread: [(time.perf_counter(), MiB)]."""

    def __init__(self, every: float = 0.02):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append((time.perf_counter(), rss_mib()))

    def between(self, t0: float, t1: float) -> list[float]:
        return [m for t, m in self.samples if t0 <= t < t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def drive(url: str, server, args, admin: dict) -> dict:
    """The client loops, the reload in the middle: the records by phase and the reload's timestamps."""
    import httpx

    from nanoserve.bench.client import send

    stop, records, marks = asyncio.Event(), [], {}
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def client(http):
        while not stop.is_set():
            record, _ = await send(http, url, body)
            records.append(record)

    async with httpx.AsyncClient(timeout=600) as http:
        clients = [asyncio.create_task(client(http)) for _ in range(args.clients)]
        await asyncio.sleep(args.before_s)
        marks["reload_start"] = time.perf_counter()
        r = await http.post(f"{url}/admin/reload", headers=admin, json={"weights": args.to_weights,
                                                                         "warmup_requests": args.warmup_requests})
        marks["switch"] = time.perf_counter()
        marks["reload"] = r.json()
        while server.state.versions.retiring:
            await asyncio.sleep(0.02)
        marks["retired"] = time.perf_counter()
        await asyncio.sleep(args.after_s)
        stop.set()
        await asyncio.gather(*clients)
    marks["records"] = records
    return marks


def run(args):
    from nanoserve.llm import LLM
    from nanoserve.server.runner import serving
    from nanoserve.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_gguf()

    def loader(weights, model_file):
        return LLM(model_file, weights=weights, kv_cache_memory=args.kv_cache_mib << 20, tokenizer=tokenizer).engine

    baseline = rss_mib()
    blue = loader(args.from_weights, None)
    blue_ref = weakref.ref(blue)
    one_version = rss_mib() - baseline
    sampler = RSSSampler()
    admin = {"Authorization": "Bearer bench-admin"}
    with serving(blue, tokenizer, loader=loader, admin_key="bench-admin", weights=args.from_weights,
                 warmup_requests=args.warmup_requests) as (url, server):
        del blue  # the server holds the only reference: retiring it frees it
        marks = asyncio.run(drive(url, server, args, admin))
    sampler.stop()
    t0, t1, t2 = marks["reload_start"], marks["switch"], marks["retired"]
    phase_of = {"before": (0, t0), "during": (t0, t1), "after": (t1, float("inf"))}
    print(f"command: python -m nanoserve bench bluegreen --from {args.from_weights} --to {args.to_weights} "
          f"--clients {args.clients} --max-tokens {args.max_tokens} --before-s {args.before_s:g} --after-s "
          f"{args.after_s:g} --warmup-requests {args.warmup_requests} --kv-cache-mib {args.kv_cache_mib}"
          + (f" --threads {args.threads}" if args.threads else ""))
    print(f"threads: {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} (shared machine: compare "
          f"phases within this run); reload: {marks['reload']}")
    print(f"{'phase':8s} {'requests':>9s} {'failed':>7s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s}")
    rows = {}
    for phase, (a, b) in phase_of.items():
        recs = [r for r in marks["records"] if a <= r.start < b]
        ttfts = [(r.chunk_times[0] - r.start) * 1000 for r in recs if r.success and r.chunk_times]
        rows[phase] = dict(requests=len(recs), failed=sum(not r.success for r in recs),
                           p50=percentile(ttfts, 50) if ttfts else float("nan"),
                           p99=percentile(ttfts, 99) if ttfts else float("nan"))
        print(f"{phase:8s} {rows[phase]['requests']:9d} {rows[phase]['failed']:7d} {rows[phase]['p50']:12.0f} "
              f"{rows[phase]['p99']:12.0f}")
    before = sampler.between(0, t0)
    peak = max(sampler.between(t0, t2) or [float("nan")])
    after = sampler.between(t2 + 1.0, float("inf")) or sampler.between(t2, float("inf"))
    print(f"TTFT p99 during the switch / before: {rows['during']['p99'] / rows['before']['p99']:.2f}x; "
          f"after / before: {rows['after']['p99'] / rows['before']['p99']:.2f}x")
    print(f"resident memory: one version loaded +{one_version:.0f} MiB; before the reload {before[-1]:.0f} MiB, peak "
          f"while both were loaded {peak:.0f} MiB (+{peak - before[-1]:.0f}), after blue retired {min(after):.0f} MiB")
    print(f"blue's engine collected (a weakref to it dead): {blue_ref() is None}")
    failed = sum(r["failed"] for r in rows.values())
    print(f"failed requests across the switch: {failed}")
    return 1 if failed else 0
