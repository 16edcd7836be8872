"""`python -m nanoserve bench degrade`: a burst of requests with and without --degrade-under-load (chapter 10).

The same burst (--requests chat prompts, all arriving at once; --max-num-seqs run, the rest wait) goes to
three engines stepped in lockstep, each timed on its own clock (bench weights' `lockstep`):

  fp32            float32 weights, no degradation: the reference for quality
  fp32+degrade    the same float32 weights and a q4 copy, bare as LLM(degrade_under_load=N) loads it (the
                  kernel up to QUANT_MAX_TOKENS, dequantized beyond): with --threshold requests waiting, steps
                  run on the q4 copy until the queue is down to half of it
  q4              q4 weights all the time with LLM(weights="q4")'s crossover (set_kernel_crossover's
                  defaults: the kernel up to KERNEL_CROSSOVER_TOKENS, the large-step copy beyond), every step
                  through the model's forward (LLM would run its decode steps of one-token rows in chapter 09's
                  native decode step, up to cpu_decode.max_rows rows): the other end of the trade

Per engine: TTFT p50 / p99 (every request arrives at 0 on its engine's clock), output tok/s, the share of
tokens computed on q4 weights, and the quality cost: greedy agreement with the fp32 run's tokens, counted
up to each request's first divergence (after it the two continue different texts), as `bench quality` does.
"""

import os
import time

import torch

from nanoserve.cli.checks import positive_int
from nanoserve.metrics import percentile

SYSTEMS = ["fp32", "fp32+degrade", "q4"]


def register(sub):
    p = sub.add_parser("degrade", help="a burst with and without --degrade-under-load: TTFT, tok/s, quality (chapter 10)")
    p.add_argument("--requests", type=positive_int, default=48, help="requests in the burst, all arriving at once")
    p.add_argument("--max-num-seqs", type=positive_int, default=8, help="requests running at once; the rest wait")
    p.add_argument("--threshold", type=positive_int, default=16, help="--degrade-under-load: waiting requests that degrade")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="greedy output tokens per request (EOS ignored)")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (bench/prompts.py course_prompts)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores; on a busy machine use 1, as bench weights --help says)")
    p.set_defaults(func=run)


def summarize(steps: list, reference: dict[str, list[int]] | None = None) -> dict:
    """From lockstep's [(clock, outputs)] of one engine: TTFT p50/p99, tok/s, share of q4 tokens, agreement."""
    from nanoserve.bench.quality import first_divergence

    first, final = {}, {}
    for clock, outputs in steps:
        for out in outputs:
            first.setdefault(out.request_id, clock)
            if out.finished:
                final[out.request_id] = out
    tokens = {rid: out.token_ids for rid, out in final.items()}
    precisions = [p for out in final.values() for p in out.metrics.get("token_precisions", [])]
    total = sum(map(len, tokens.values()))
    row = dict(ttft_p50=percentile(list(first.values()), 50), ttft_p99=percentile(list(first.values()), 99),
               tok_s=total / steps[-1][0], degraded=precisions.count("q4") / total if precisions else None)
    if reference is not None:
        div = [first_divergence(tokens[rid], reference[rid]) for rid in reference]
        row.update(agreement=sum(div) / sum(map(len, reference.values())), identical=sum(d == len(reference[rid]) for d, rid in zip(div, reference)))
    return row, tokens


def run(args):
    from nanoserve.bench.prompts import course_prompts
    from nanoserve.bench.weights import lockstep
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.model import load_gguf
    from nanoserve.model.quant import set_kernel_crossover
    from nanoserve.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    # two q4 models: the degrading engine's copy stays bare, as LLM loads it; the q4 engine's gets
    # LLM(weights="q4")'s crossover (llm.py), through the model's forward: no native decode step
    fp32, degraded, q4 = load_gguf(weights="fp32"), load_gguf(weights="q4"), load_gguf(weights="q4")
    set_kernel_crossover(q4)
    tokenizer = Tokenizer.from_gguf()
    # short chat prompts (no long documents): the burst is about queueing, not about prefill
    prompts = [tokenizer.encode_chat(p["messages"]) for p in course_prompts(args.requests, args.seed, ("chat", "system"))]
    requests = [(ids, args.max_tokens) for ids in prompts]

    def config(**kw):
        return engine_config(kv_cache_memory=256 << 20, max_num_seqs=args.max_num_seqs, **kw)

    engines = {"fp32": LLMEngine(fp32, config()),
               "fp32+degrade": LLMEngine(fp32, config(degrade_under_load=args.threshold), degraded_model=degraded),
               "q4": LLMEngine(q4, config())}
    with torch.inference_mode():
        lockstep(engines, requests[:4])  # warm up (4 requests: below any threshold)
        steps = {}
        lockstep(engines, requests, outputs=steps)
    ref_row, reference = summarize(steps["fp32"])
    rows = {"fp32": ref_row} | {name: summarize(steps[name], reference)[0] for name in SYSTEMS[1:]}

    print(f"command: python -m nanoserve bench degrade --requests {args.requests} --max-num-seqs {args.max_num_seqs} "
          f"--threshold {args.threshold} --max-tokens {args.max_tokens} --seed {args.seed}"
          + (f" --threads {args.threads}" if args.threads else ""))
    print(f"threads: {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; a burst of {args.requests} chat "
          f"requests at t=0, {args.max_num_seqs} run at once, {args.max_tokens} greedy tokens each (EOS ignored); "
          f"degrade with >= {args.threshold} waiting, back at <= {args.threshold // 2}")
    print(f"{'system':14s} {'TTFT p50 s':>11s} {'TTFT p99 s':>11s} {'out tok/s':>10s} {'q4 tokens':>10s} "
          f"{'agreement':>10s} {'identical':>10s}")
    for name, r in rows.items():
        degraded = {"fp32": 0.0, "q4": 1.0}.get(name, r["degraded"])
        agreement = f"{r['agreement']:10.1%} {r['identical']:5d}/{args.requests:<4d}" if "agreement" in r else \
            f"{'(ref)':>10s} {'':10s}"
        print(f"{name:14s} {r['ttft_p50']:11.2f} {r['ttft_p99']:11.2f} {r['tok_s']:10.1f} {degraded:10.1%} {agreement}")
    base = rows["fp32"]
    for name in SYSTEMS[1:]:
        print(f"{name} vs fp32: TTFT p99 {base['ttft_p99'] / rows[name]['ttft_p99']:.2f}x shorter, "
              f"throughput {rows[name]['tok_s'] / base['tok_s']:.2f}x")
    print(f"(agreement: share of the fp32 run's tokens reproduced before each request's first divergence; "
          f"{time.perf_counter() - start:.0f} s in all, load average at the end {os.getloadavg()[0]:.2f})")
