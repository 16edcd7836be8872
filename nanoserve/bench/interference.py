"""`python -m nanoserve bench experiment disagg-interference` (chapter 17): what long prompts arriving do to streams
that are decoding, with prefill and decode in one engine or in two.

    workload   --streams clients, each streaming one request after another (a 32-token prompt of random ids, then
               --output-len tokens, greedy, EOS ignored) until the last long prompt has its answer; and
               --long-prompts prompts of --long-len random ids (16 output tokens each), one every --long-every
               seconds. The same ids for every system and every round; every prompt is its own, so no prefix hits.
    systems    colocated, budget B   `serve --threads 2 --max-num-batched-tokens B`: one engine, chunked prefill at
                                     chapter 06's budgets (--budgets), prefill chunks and decodes in the same steps
               disaggregated         `serve --disaggregated --threads 1`: a prefill and a decode engine of one
                                     thread each (chapter 17's pair), and its proxy
               Both hold 2 torch threads in all, float32 weights and pool, the same number of KV blocks per engine.
               The benchmark's clients and the pair's proxy are Python processes on the same cores.
    rounds     --rounds rounds; each starts every system afresh (`serve` in a process of its own), warms it up with
               one short and one long request (not counted), measures, stops it; the order alternates (A B C, C B A)
    measured   on the client's clock (`bench serve`'s client, nanoserve/bench/client.py; nanoserve/metrics.py): the
               streams' inter-token latency p50 / p99 (every gap of every stream request), the long prompts' TTFT
               p50 / p99, output tokens/s of all requests over the run, failed requests. Each system keeps its
               round with the most output tokens/s (the least disturbed by the rest of the machine).
"""

import asyncio
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

from nanoserve.bench.experiment import interleaved, random_prompt

STREAM_PROMPT, STREAM_OUTPUT = 32, 64  # each stream request's prompt and output tokens (--output-len)
LONG_OUTPUT, BLOCK = 16, 16  # each long prompt's output tokens; the KV block size


def systems(budgets: list[int], num_blocks: int) -> dict[str, list[str]]:
    """name -> `serve`'s flags: every system 2 torch threads in all."""
    common = ["--weights", "fp32", "--num-blocks", str(num_blocks), "--shutdown-timeout", "2"]
    return {**{f"colocated, budget {b}": [*common, "--threads", "2", "--max-num-batched-tokens", str(b)]
               for b in budgets},
            "disaggregated, 1 + 1 threads": [*common, "--disaggregated", "--threads", "1"]}


def start_serving(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m nanoserve serve FLAGS --port 0` in a process of its own: (the process, its URL) once it serves."""
    from nanoserve.cli.pair import read_stdout

    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", *flags, "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    urls = queue.Queue()
    threading.Thread(target=read_stdout, args=(proc, urls.put), daemon=True).start()
    while True:
        try:
            return proc, urls.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                raise RuntimeError(f"`serve {' '.join(flags)}` exited with status {proc.returncode} before serving")


def stop_serving(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def body(model: str, ids: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def drive(url: str, vocab: int, args, n_out: int, longs: list[list[int]], warm: list[list[int]]) -> dict:
    """The workload against one server: the streams' records, the long prompts' records, the run's seconds."""
    import httpx

    from nanoserve.bench.client import send
    from nanoserve.bench.serve import first_model

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=limits) as client:
        model = await first_model(client, url)
        for ids, n in ((warm[0], 4), (warm[1], 1)):  # both paths once, connections opened: not counted
            record, _ = await send(client, url, body(model, ids, n))
            if not record.success:
                raise RuntimeError(f"the warm-up request failed: {record.error}")
        streams, finished, t0 = [], asyncio.Event(), time.perf_counter()

        async def stream_client(k: int):
            i = 0
            while not finished.is_set():  # the next request of this stream: a prompt of its own
                ids = random_prompt(random.Random(1_000_000 + 1000 * k + i), STREAM_PROMPT, vocab)
                streams.append((await send(client, url, body(model, ids, n_out)))[0])
                i += 1

        async def long_prompt(j: int):
            await asyncio.sleep(max(0.0, t0 + (j + 1) * args.long_every - time.perf_counter()))
            return (await send(client, url, body(model, longs[j], LONG_OUTPUT)))[0]

        clients = [asyncio.create_task(stream_client(k)) for k in range(args.streams)]
        long_records = await asyncio.gather(*(long_prompt(j) for j in range(len(longs))))
        finished.set()
        await asyncio.gather(*clients)
    return {"streams": streams, "longs": long_records, "seconds": time.perf_counter() - t0}


def summary(run: dict) -> dict:
    from nanoserve.metrics import itl, stats, ttft

    records = run["streams"] + run["longs"]
    ok = [r for r in records if r.success]
    gaps = [g * 1000 for r in run["streams"] if r.success for g in itl(r.chunk_times)]
    firsts = [ttft(r.start, r.chunk_times) * 1000 for r in run["longs"] if r.success and r.chunk_times]
    return {"stream_itl_ms": stats(gaps), "long_ttft_ms": stats(firsts), "long_ttfts_ms": firsts,
            "output_throughput": sum(r.output_tokens for r in ok) / run["seconds"], "seconds": run["seconds"],
            "stream_requests": len(run["streams"]), "failed": len(records) - len(ok),
            "errors": [r.error for r in records if not r.success][:5]}


def disagg_interference(args, model, tokenizer) -> tuple[dict, object]:
    vocab, rng, n_out = tokenizer.vocab_size, random.Random(0), args.output_len or STREAM_OUTPUT
    longs = [random_prompt(rng, args.long_len, vocab) for _ in range(args.long_prompts)]
    warm = [random_prompt(rng, STREAM_PROMPT, vocab), random_prompt(rng, args.long_len, vocab)]
    # every stream and every long prompt in the pool at once, with room to spare: nothing waits for blocks
    blocks = args.streams * math.ceil((STREAM_PROMPT + n_out) / BLOCK)
    num_blocks = 2 * (blocks + args.long_prompts * math.ceil((args.long_len + LONG_OUTPUT) / BLOCK))
    print(f"{args.streams} streams ({STREAM_PROMPT}-token prompts, {n_out} tokens each, one after another); "
          f"{args.long_prompts} prompts of {args.long_len} tokens, one every {args.long_every:g} s; "
          f"{num_blocks} KV blocks per engine; {args.rounds} interleaved round(s); load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)

    def measure(name, flags, r):
        proc, url = start_serving(flags)
        try:
            x = summary(asyncio.run(drive(url, vocab, args, n_out, longs, warm)))
        finally:
            stop_serving(proc)
        print(f"  round {r + 1} {name:30s} stream ITL p50 {x['stream_itl_ms']['median'] or 0:6.0f} p99 "
              f"{x['stream_itl_ms']['p99'] or 0:6.0f} ms  long TTFT p50 {x['long_ttft_ms']['median'] or 0:6.0f} p99 "
              f"{x['long_ttft_ms']['p99'] or 0:6.0f} ms  {x['output_throughput']:6.1f} out tok/s  failed {x['failed']}",
              flush=True)
        return x

    runs = interleaved(args.rounds, systems(args.budgets, num_blocks), measure)
    best = {name: max(xs, key=lambda x: x["output_throughput"]) for name, xs in runs.items()}
    print(f"\n{'system (best round)':32s}{'stream ITL p50':>15s}{'p99':>8s}{'long TTFT p50':>15s}{'p99':>8s}"
          f"{'out tok/s':>11s}{'failed':>8s}")
    for name, x in best.items():
        print(f"{name:32s}{x['stream_itl_ms']['median'] or 0:12.0f} ms{x['stream_itl_ms']['p99'] or 0:5.0f} ms"
              f"{x['long_ttft_ms']['median'] or 0:12.0f} ms{x['long_ttft_ms']['p99'] or 0:5.0f} ms"
              f"{x['output_throughput']:11.1f}{x['failed']:8d}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
        names, width = list(best), 0.2
        for k, (metric, p, hatch) in enumerate([("stream_itl_ms", "median", ""), ("stream_itl_ms", "p99", "//"),
                                                ("long_ttft_ms", "median", ""), ("long_ttft_ms", "p99", "//")]):
            a.bar([i + (k - 1.5) * width for i in range(len(names))], [best[n][metric][p] or 0 for n in names],
                  width, hatch=hatch, color="C0" if metric == "stream_itl_ms" else "C1", edgecolor="white",
                  label=f"{'stream ITL' if metric == 'stream_itl_ms' else 'long prompt TTFT'} {p}")
        a.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
        a.set(ylabel="ms", yscale="log", title="ITL of the streams vs TTFT of the long prompts")
        a.legend(fontsize=8)
        b.bar(range(len(names)), [best[n]["output_throughput"] for n in names], color="C2")
        b.set_xticks(range(len(names)), [n.split(",")[0] + ("\n" + n.split(", ")[1] if "," in n else "")
                                         for n in names], fontsize=7)
        b.set(ylabel="output tokens/s", title="throughput")
        fig.suptitle(f"{args.streams} streams decoding while {args.long_len}-token prompts arrive every "
                     f"{args.long_every:g} s; 2 threads in all (best of {args.rounds} interleaved rounds)")
        return fig

    return {"streams": args.streams, "output_len": n_out, "long_prompts": args.long_prompts,
            "long_len": args.long_len, "long_every_s": args.long_every, "num_blocks": num_blocks,
            "systems": systems(args.budgets, num_blocks), "rounds": runs, "best": best}, figure
