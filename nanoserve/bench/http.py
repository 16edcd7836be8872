"""`python -m nanoserve bench http`: what does HTTP cost? The same requests through the offline engine
and through the server with C concurrent streaming clients, side by side in one run.

For each concurrency C (default 16 and 32) and each round, one workload of C requests (random prompt
ids of 20-200 tokens, 128 output tokens each, greedy, EOS ignored) runs twice:

  offline   every request handed to an LLMEngine at once, stepped until done (chapter 06)
  HTTP      C clients at once, each streaming one request from POST /v1/completions (the prompt as
            token ids, so both systems get the very same ids), server and clients in this process

Each system has an engine of its own on the same model, and each round a fresh workload, so neither
profits from the other's prefix cache. The order alternates between rounds (offline first, then HTTP
first) so the machine's drift cancels from the ratio. Reported: aggregate output tokens/s (all output
tokens / wall time from the first request to the last token), TTFT and ITL p50/p99 by chapter 09's one
definition (nanoserve/metrics.py): for offline from Sequence.metrics() on the engine's clock, for HTTP
from `bench serve`'s client (nanoserve/bench/client.py) on the client's clock.

The header says what ran: the threads, the CPU, the weights and KV pool, and for q4 where its decode steps of
one-token rows run (serve's banner's words, cli/serve.py one_token_rows) with how many rows a native step takes
(cpu_decode.max_rows). That number sets what a concurrency measures: where it is 16, a C = 16 run's decode-only
steps go through chapter 09's native step, while a C = 32 run's go through the model's forward until 16 or fewer
requests are left; where it is 1 (a CPU with native bf16), both go through the forward but for the last request.
"""

import asyncio
import contextlib
import random
import time

import torch

from nanoserve.metrics import percentile


def register(sub):
    p = sub.add_parser("http", help="HTTP server with C streaming clients vs the offline engine (chapter 08)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p) -> None:
    from nanoserve.cli.batch import add_engine_args

    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    p.add_argument("--prompt-len", type=int, nargs=2, default=[20, 200], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="workloads per concurrency, alternating the order")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)


def workload(n: int, prompt_len, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]


def run_offline(engine, prompts, params) -> tuple[float, list[dict]]:
    """(wall seconds, per-request Sequence.metrics())."""
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    metrics = []
    while engine.has_unfinished_requests():
        metrics += [out.metrics for out in engine.step() if out.finished]
    return time.perf_counter() - t0, metrics


def run_http(url: str, prompts, max_tokens: int) -> tuple[float, list[dict]]:
    """(wall seconds, per-request latencies): C clients at once, each streaming one request through chapter 09's
    client (nanoserve/bench/client.py: the client's clock, output tokens from the usage chunk)."""
    import httpx

    from nanoserve.bench.client import send
    from nanoserve.metrics import request_latencies

    async def main():
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            return await asyncio.gather(*(send(client, url, {
                "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) for p in prompts))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    seconds = time.perf_counter() - t0
    failed = [record.error for record, _ in results if not record.success]
    if failed:
        raise RuntimeError(f"{len(failed)} HTTP request(s) failed, the first: {failed[0]}")
    return seconds, [{**request_latencies(record), "num_output_tokens": record.output_tokens} for record, _ in results]


def percentiles(values: list[float]) -> str:
    return f"{percentile(values, 50) * 1000:7.0f} / {percentile(values, 99) * 1000:7.0f}"


def run(args):
    from nanoserve.bench.offline import cpu_description, served_format
    from nanoserve.cli.batch import command_line, llm_from_args
    from nanoserve.cli.serve import one_token_rows
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.kernels.cpu_decode import max_rows
    from nanoserve.sampling import SamplingParams
    from nanoserve.server.runner import serving

    llm = llm_from_args(args)  # its engine runs the offline side
    served = LLMEngine(llm.model, llm.engine.config, llm.tokenizer)  # the server's own, same model and knobs
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    weights, pool = served_format(llm.model, served)
    print("command: " + command_line(args, add_arguments, "bench http"))
    rows = one_token_rows(args, max_rows(llm.model) if getattr(llm.model, "native_decode", False) else 1)
    print(f"threads: {torch.get_num_threads()}; {cpu_description()}; weights {weights}, KV pool {pool}, "
          f"{served.block_manager.num_blocks} blocks of {args.block_size} tokens per engine; "
          f"{rows + '; ' if rows else ''}server and clients in this process")
    # both engines stop what they started beside themselves (a tier's file and writer, a KV connector)
    with llm, contextlib.closing(served), serving(served, llm.tokenizer) as (url, _):
        warm = workload(2, (8, 16), vocab, -1)
        run_offline(llm.engine, warm, SamplingParams(temperature=0, max_tokens=4))
        run_http(url, warm, 4)
        print(f"{'C':>3} {'system':8} {'out tok/s':>10} {'TTFT p50 / p99 ms':>18} {'ITL p50 / p99 ms':>18}")
        for c in args.concurrency:
            totals = {"offline": [0.0, []], "HTTP": [0.0, []]}  # seconds, metrics
            for r in range(args.rounds):
                prompts = workload(c, args.prompt_len, vocab, args.seed + 1000 * c + r)
                runs = [("offline", lambda: run_offline(llm.engine, prompts, params)),
                        ("HTTP", lambda: run_http(url, prompts, args.output_len))]
                for name, go in runs if r % 2 == 0 else runs[::-1]:
                    seconds, metrics = go()
                    totals[name][0] += seconds
                    totals[name][1] += metrics
            rates = {}
            for name, (seconds, metrics) in totals.items():
                rates[name] = sum(m["num_output_tokens"] for m in metrics) / seconds
                itl = [gap for m in metrics for gap in m["itl"]]
                print(f"{c:3d} {name:8} {rates[name]:10.1f} {percentiles([m['ttft'] for m in metrics]):>18} "
                      f"{percentiles(itl):>18}")
            print(f"    HTTP keeps {100 * rates['HTTP'] / rates['offline']:.1f} % of the offline output tokens/s "
                  f"({args.rounds} rounds of {c} requests each, order alternating)")
