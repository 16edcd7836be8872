"""`python -m nanoserve bench experiment NAME`: chapter 09's comparison experiments, one command each.

Each writes results/experiments/NAME.json and NAME.png and prints its table. The offline ones drive the
engine step by step (requests added at given steps, every output stamped on one clock, metrics from
nanoserve/metrics.py); the HTTP ones go through `bench serve` against a server.

  chunked-prefill  TTFT of a lone prompt vs its length, chunked prefill on / off; and the ITL spike a long
                   prompt arriving causes to 4 running streams, on / off
  prefill-budget   chapter 06's trade-off: streams decoding while long prompts arrive, for chunked-prefill
                   budgets (max_num_batched_tokens) 256 / 512 / 2048 and chunking off: the streams' ITL and
                   the long prompts' TTFT, p50 / p99
  overload         an undersized KV pool: blocks used, waiting queue and preemptions, step by step
  prefix-caching   requests sharing a system prompt (174 common tokens), prefix caching on / off: TTFT and throughput
  block-size       8 / 16 / 32 tokens per block: the slots wasted in partly filled blocks vs tokens/s
  dtype            float32 vs bfloat16 weights and KV on this CPU: tokens/s and greedy agreement
  concurrency      through HTTP: throughput, TTFT and TPOT vs the number of concurrent clients (1, 4, 16, 64;
                   the server's prefix cache off: every level re-sends the same prompts)
  servers          through HTTP: `bench serve` against several servers, interleaved round by round
  scheduling       chapter 15: a bursty two-tenant workload under each scheduling policy (fcfs, priority, slo,
                   slo + reject, fair): TTFT / TPOT p50 / p99, goodput, % meeting SLO, rejected, KV use
  noisy-neighbour  chapter 15: one tenant floods (four times the engine's seats), another sends short requests:
                   the victim's TTFT under priority (first come, first served) and fair
  prefix-isolation chapter 08: with --api-keys, tenant B's TTFT for a ~1,200-token prefix tenant A sent, against
                   a cold miss and B's own hit (SmolLM2 over HTTP; nanoserve/bench/isolation.py)
  routing          chapter 16: one replica of 2 cores vs two of 1 core under round robin, power of two choices
                   and prefix affinity, users with long system prompts: TTFT mean / p99, errors, hit rate,
                   each replica's share of the work (nanoserve/bench/routing.py)
  kv-routing       chapter 17: replicas in this process publishing KV events; round-robin, pow2, chapter 16's
                   prefix router and the KV-aware router on their events, users sharing one application's system
                   prompt (or, --workload per-user, a prompt each): hit rate, TTFT (bench/kv_routing.py)
  disagg-interference  chapter 17: streams decoding while long prompts arrive, one engine of 2 threads (chunked
                   prefill at chapter 06's budgets) vs a prefill and a decode engine of 1 thread each (`serve
                   --disaggregated`): the streams' ITL, the long prompts' TTFT, out tok/s (bench/interference.py)
  returning-users  chapter 18: users returning after others, a pool too small for them: no tier, the file
                   tier, an int8 pool: hits per tier, TTFT p50 / p99 (nanoserve/bench/kv_tiers.py)
  kv-crossover     chapter 18: recompute vs load from the file tier, measured; the load-or-recompute map
  kv-dtypes        chapter 18: blocks in 1 GiB and the logit error per KV dtype (fp32, bf16, int8, fp8)
  swap-vs-recompute chapter 18: overload's workload and pool, preempting by recompute vs by swap to the file tier:
                   preemptions, tokens recomputed, blocks swapped, TTFT / TPOT p99, throughput
  sleep            chapter 19: SmolLM2 served, put to sleep at level 1 and level 2 and woken: resident memory
                   awake, asleep and after wake, the bytes released, the wake time (nanoserve/bench/sleep.py)

Systems compared are interleaved, the order alternating (A, B, then B, A, ...), and each keeps its best round:
this machine drifts. prefill-budget first runs one untimed warm-up round of every budget.
"""

import argparse
import importlib
import json
import os
import random
import sys
import time

import torch

from nanoserve.cli.checks import positive_int, weight_format

EXPERIMENTS = ["chunked-prefill", "prefill-budget", "overload", "prefix-caching", "block-size", "dtype", "concurrency", "servers",
               "scheduling", "noisy-neighbour", "prefix-isolation", "routing", "kv-routing", "disagg-interference",
               "returning-users", "kv-crossover", "kv-dtypes", "swap-vs-recompute", "sleep"]


KV_ROUTING_REPLICAS, KV_ROUTING_BLOCKS = 3, 96  # kv-routing's fleet: replicas, and KV blocks in each one's pool
INTERFERENCE_DEFAULTS = {"streams": 8, "long_prompts": 6, "long_len": 1024, "long_every": 3.0, "budgets": [256, 512, 2048]}

# The flags each experiment reads (--out-dir: every one). Any other flag given is refused, even at its default value:
# a flag an experiment dropped would let the reader believe the run was what it was not.
_ENGINE = {"threads", "rounds", "output_len"}  # the experiments that drive engines in this process
USES = {
    "chunked-prefill": _ENGINE, "prefill-budget": _ENGINE, "overload": {"threads", "output_len"},
    "prefix-caching": _ENGINE, "block-size": _ENGINE, "dtype": _ENGINE,
    "concurrency": _ENGINE | {"url", "concurrency"},  # --threads: only for the server it starts itself (no --url)
    "servers": {"url", "rounds", "num_prompts", "output_len"},
    "scheduling": _ENGINE, "noisy-neighbour": {"threads", "rounds"}, "prefix-isolation": {"threads", "rounds"},
    "routing": {"rounds", "num_users", "output_len"},  # each replica has its cores: --threads would set none of them
    "kv-routing": _ENGINE | {"num_users", "replicas", "num_blocks", "workload", "student"},
    "disagg-interference": {"rounds", "output_len", *INTERFERENCE_DEFAULTS},  # its servers run 2 threads in all
    "returning-users": _ENGINE | {"num_users"}, "kv-crossover": {"threads", "rounds"}, "kv-dtypes": {"threads"},
    "swap-vs-recompute": _ENGINE, "sleep": {"threads", "rounds", "weights", "kv_cache_mib"},
}


class Given(argparse.Action):
    """Stores a flag's value (appending, for --url) and records that the flag was given (args.given)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest == "url":
            values = [*(getattr(namespace, "url") or []), values]
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def register(sub):
    p = sub.add_parser("experiment", help="one of chapter 09's experiments: JSON + figure (see its help)")
    p.add_argument("name", choices=EXPERIMENTS)
    p.add_argument("--out-dir", default="results/experiments")
    p.add_argument("--rounds", type=int, default=2, action=Given, help="interleaved rounds per system (the best is kept)")
    p.add_argument("--threads", type=int, default=None, action=Given, help="torch threads (default: torch's)")
    p.add_argument("--url", default=None, action=Given,
                   help="concurrency / servers: a server to measure (repeat for servers; NAME=URL names it). "
                        "concurrency without --url starts nanoserve in this process, its prefix cache off")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], action=Given)
    p.add_argument("--num-prompts", type=int, default=16, action=Given, help="servers: requests per round")
    p.add_argument("--num-users", type=int, default=8, action=Given, help="routing, returning-users, kv-routing: users")
    p.add_argument("--replicas", type=int, default=KV_ROUTING_REPLICAS, action=Given,
                   help="kv-routing: replicas (engines in this process)")
    p.add_argument("--num-blocks", type=int, default=KV_ROUTING_BLOCKS, action=Given, help="kv-routing: KV blocks per replica")
    p.add_argument("--workload", default=None, action=Given,
                   help="kv-routing: shared-prompts (one application's system prompt, every user's; the default) or "
                        "per-user (a system prompt each)")
    p.add_argument("--student", default=None, metavar="CHAPTERS", action=Given,
                   help="kv-routing: your finished exercises route (\"17\": the KV index and score, exercise 17)")
    d = INTERFERENCE_DEFAULTS
    p.add_argument("--streams", type=int, default=d["streams"], action=Given,
                   help="disagg-interference: clients streaming while long prompts arrive")
    p.add_argument("--long-prompts", type=int, default=d["long_prompts"], action=Given,
                   help="disagg-interference: long prompts per round")
    p.add_argument("--long-len", type=int, default=d["long_len"], action=Given,
                   help="disagg-interference: tokens of each long prompt")
    p.add_argument("--long-every", type=float, default=d["long_every"], metavar="S", action=Given,
                   help="disagg-interference: seconds between long prompts (the first S seconds in)")
    p.add_argument("--budgets", type=int, nargs="+", default=d["budgets"], action=Given,
                   help="disagg-interference: the colocated engine's chunked-prefill budgets (max_num_batched_tokens)")
    p.add_argument("--output-len", type=int, default=None, action=Given,
                   help="output tokens per request (each experiment has its default)")
    p.add_argument("--weights", nargs="+", type=weight_format, default=None, action=Given,
                   help="sleep: the weights formats served, each on `serve`'s KV dtype for it (default: fp32 q4)")
    p.add_argument("--kv-cache-mib", type=positive_int, default=None, action=Given,
                   help="sleep: the KV pool (default 1024, serve's)")
    p.set_defaults(func=run, given=frozenset())


# ---- driving the engine --------------------------------------------------------------------------------------

def greedy(n: int):
    from nanoserve.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def drive(engine, arrivals: list[tuple[int, str, list[int], int]]) -> tuple[dict, list[dict]]:
    """Run `arrivals` [(step, request id, prompt ids, output tokens[, add_request kwargs])] to the end: each
    request is added just before engine step `step`. Returns ({id: RequestRecord}, one trace row per step).
    A request the scheduling policy refused (chapter 15) is a failed record, its reason the error."""
    from nanoserve.bench.offline import stamp_outputs
    from nanoserve.engine.sequence import SequenceStatus
    from nanoserve.metrics import RequestRecord

    pending = sorted(arrivals, key=lambda a: a[0])
    records, trace, step, t0 = {}, [], 0, time.perf_counter()
    preemptions = recomputed = computed = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, pending[0][0])  # idle: jump to the next arrival
        while pending and pending[0][0] <= step:
            _, rid, prompt, n, *kwargs = pending.pop(0)
            records[rid] = RequestRecord(start=time.perf_counter() - t0, prompt_tokens=len(prompt))
            engine.add_request(rid, prompt, greedy(n), **(kwargs[0] if kwargs else {}))
        held = {seq.seq_id: seq.num_computed_tokens for seq in engine.scheduler.running}
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter() - t0
        for rejected in [o for o in outputs if getattr(o, "reject_reason", None)]:
            records[rejected.request_id].success, records[rejected.request_id].error = False, rejected.reject_reason
        stamp_outputs(records, outputs, now)
        out, blocks, sched = engine.last_scheduler_output, engine.block_manager, engine.scheduler
        preemptions += len(out.preempted_seq_ids)
        # the computed tokens a recompute preemption threw away: recomputed when the victim is readmitted (less what
        # the prefix cache still holds, if it is on); a victim swapped out to the KV tier (chapter 18) keeps them
        recomputed += sum(held.get(seq_id, 0) for seq_id in out.preempted_seq_ids
                          if sched.seqs[seq_id].status is SequenceStatus.PREEMPTED)
        computed += out.total_num_scheduled_tokens
        used = blocks.num_blocks - blocks.get_num_free_blocks()
        trace.append({"step": step, "t": now, "step_ms": (now - (before - t0)) * 1000,
                      "num_tokens": sum(out.num_scheduled_tokens.values()), "running": len(sched.running),
                      "waiting": len(sched.waiting), "blocks_used": used, "num_blocks": blocks.num_blocks,
                      "tokens_held": sum(s.num_computed_tokens for s in sched.running), "preemptions": preemptions,
                      "recomputed_tokens": recomputed, "computed_tokens": computed})
        step += 1
    return records, trace


def engine_for(model, tokenizer=None, **config):
    """An engine from LLM's flat settings (block_size=…, max_num_seqs=…, speculative=…)."""
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine

    return LLMEngine(model, engine_config(**config), tokenizer)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(20, vocab) for _ in range(n)]


def interleaved(rounds: int, systems: dict, measure, first: int = 0) -> dict:
    """{name: [result per round]}, measuring A, B, then B, A, then A, B, ...: each system sees the same drift, and
    none always runs first (the first of a round follows whatever the last round left behind). first: the index of
    the first round, for a caller that runs its rounds one call at a time (what measure gets and the progress
    lines print; the order still starts with A, B)."""
    results = {name: [] for name in systems}
    order = list(systems.items())
    for r in range(rounds):
        for name, system in order if r % 2 == 0 else order[::-1]:
            results[name].append(measure(name, system, first + r))
            print(f"  round {first + r + 1} {name}: done", file=sys.stderr, flush=True)
    return results


# ---- the experiments -------------------------------------------------------------------------------------------

def chunked_prefill(args, model, tokenizer) -> dict:
    from nanoserve.metrics import itl, ttft

    vocab, rng = model.config.vocab_size, random.Random(0)
    lengths = [256, 1024, 2048]
    configs = {"chunked (budget 512)": dict(enable_chunked_prefill=True, max_num_batched_tokens=512),
               "whole prompts (budget 4096)": dict(enable_chunked_prefill=False, max_num_batched_tokens=4096)}
    prompts = {n: random_prompt(rng, n, vocab) for n in lengths}
    streams = [random_prompt(rng, 32, vocab) for _ in range(4)]
    long_prompt = random_prompt(rng, 2048, vocab)
    n_out = args.output_len or 48

    def measure(name, config, r):
        engine = engine_for(model, num_blocks=1024, enable_prefix_caching=False, **config)
        lone = {}
        for n in lengths:
            records, _ = drive(engine, [(0, f"p{n}", prompts[n], 1)])
            lone[n] = ttft(records[f"p{n}"].start, records[f"p{n}"].chunk_times) * 1000
        arrivals = [(0, f"s{i}", p, n_out) for i, p in enumerate(streams)] + [(12, "long", long_prompt, 4)]
        records, trace = drive(engine, arrivals)
        gaps = [(t, g * 1000) for i in range(4) for t, g in zip(records[f"s{i}"].chunk_times[1:], itl(records[f"s{i}"].chunk_times))]
        long = records["long"]
        steps = sum(1 for row in trace if row["step"] >= 12 and row["t"] <= long.chunk_times[0])  # its prefill's steps
        return {"ttft_ms_by_prompt_len": lone, "stream_itl_ms": gaps, "max_stream_itl_ms": max(g for _, g in gaps),
                "long_prompt_arrived_s": long.start, "long_prompt_ttft_ms": ttft(long.start, long.chunk_times) * 1000,
                "long_prompt_prefill_steps": steps}

    results = interleaved(args.rounds, configs, measure)
    best = {name: dict(min(runs, key=lambda x: x["max_stream_itl_ms"])) for name, runs in results.items()}
    for name, x in best.items():
        x["ttft_ms_by_prompt_len"] = {n: min(run["ttft_ms_by_prompt_len"][n] for run in results[name]) for n in lengths}
    print(f"lone prompts: TTFT, best of {args.rounds} round(s); 4 streams decoding when a 2048-token prompt arrives: "
          f"the round with the smallest worst ITL (every round's in brackets)")
    print(f"{'':28s}" + "".join(f"{f'TTFT {n} tok':>14s}" for n in lengths) + "   max ITL of 4 streams   long prompt TTFT  steps")
    for name, x in best.items():
        every = ", ".join(f"{run['max_stream_itl_ms']:.0f}" for run in results[name])
        print(f"{name:28s}" + "".join(f"{x['ttft_ms_by_prompt_len'][n]:11.0f} ms" for n in lengths)
              + f"   {x['max_stream_itl_ms']:7.0f} ms ({every})   {x['long_prompt_ttft_ms']:9.0f} ms  "
              + f"{x['long_prompt_prefill_steps']:5d}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name, x in best.items():
            a.plot(lengths, [x["ttft_ms_by_prompt_len"][n] for n in lengths], "o-", label=name)
            t, g = zip(*sorted(x["stream_itl_ms"]))
            line = b.plot([v - x["long_prompt_arrived_s"] for v in t], g, ".-", label=name, alpha=0.8)[0]
            b.axvline(0, color=line.get_color(), ls=":", lw=1)
        a.set(xlabel="prompt tokens (alone)", ylabel="TTFT (ms)", title="TTFT vs prompt length")
        b.set(xlabel="s since a 2048-token prompt arrived", ylabel="ITL of the 4 running streams (ms)",
              title="the ITL spike a long prompt causes")
        a.legend(), b.legend()
        return fig

    return {"results": results, "best": best}, figure


BUDGETS = {"chunked, budget 256": (True, 256), "chunked, budget 512": (True, 512),
           "chunked, budget 2048": (True, 2048), "chunking off (budget 2048)": (False, 2048)}


def budget_sweep(model, budgets: dict, num_streams: int = 8, stream_output: int = 96, long_len: int = 1024,
                 long_arrivals=(8, 28, 48, 68), long_output: int = 16, rounds: int = 2, stream_len: int = 32,
                 warmup: bool = False) -> dict:
    """Chapter 06's trade-off, measured: `num_streams` requests (prompts of `stream_len` tokens) decode while
    prompts of `long_len` tokens arrive at the given steps (= when the streams have sampled that many tokens:
    every step decodes each stream once, whatever the budget). For each {name: (chunked, max_num_batched_tokens)}, interleaved
    over `rounds`: the streams' inter-token gaps and the long prompts' TTFT (ms), from the least disturbed
    round (the shortest), and two counts the clock does not touch: the most tokens one step computed (what a
    stream's worst gap waits for) and, per long prompt, the steps from its arrival to its first token.
    warmup: first one untimed round of every budget, its results dropped, so that no timed round is the process's
    first (notebook 06 calls the sweep once with rounds=1 for it instead, to read the load between the two).
    Returns {name: {"itl_ms": stats, "ttft_ms": stats, "gaps": [(step, ms)], "max_step_tokens": int,
    "long_ttft_steps": [int], ...}}."""
    from nanoserve.metrics import itl, stats, ttft

    vocab, rng = model.config.vocab_size, random.Random(0)
    streams = [random_prompt(rng, stream_len, vocab) for _ in range(num_streams)]
    longs = [random_prompt(rng, long_len, vocab) for _ in long_arrivals]
    arrivals = ([(0, f"s{i}", p, stream_output) for i, p in enumerate(streams)]
                + [(step, f"long{i}", p, long_output) for i, (step, p) in enumerate(zip(long_arrivals, longs))])

    def measure(name, budget, r):
        chunked, tokens = budget
        engine = engine_for(model, num_blocks=1024, enable_prefix_caching=False,
                            enable_chunked_prefill=chunked, max_num_batched_tokens=tokens)
        records, trace = drive(engine, arrivals)
        step_at = {row["t"]: row["step"] for row in trace}  # a chunk is stamped with its step's end time
        gaps = [(step_at[t], g * 1000) for i in range(num_streams)
                for t, g in zip(records[f"s{i}"].chunk_times[1:], itl(records[f"s{i}"].chunk_times))]
        firsts = [ttft(records[f"long{i}"].start, records[f"long{i}"].chunk_times) * 1000 for i in range(len(longs))]
        first_steps = [step_at[records[f"long{i}"].chunk_times[0]] - arrival + 1
                       for i, arrival in enumerate(long_arrivals)]  # its arrival step is the first
        return {"itl_ms": stats([g for _, g in gaps]), "max_itl_ms": max(g for _, g in gaps),
                "ttft_ms": stats(firsts), "seconds": trace[-1]["t"], "steps": len(trace), "gaps": gaps,
                "long_arrival_steps": list(long_arrivals), "max_step_tokens": max(row["num_tokens"] for row in trace),
                "long_ttft_steps": first_steps}

    if warmup:
        print("  warm-up, untimed:", file=sys.stderr, flush=True)
        interleaved(1, budgets, measure)
    results = interleaved(rounds, budgets, measure)
    return {name: min(runs, key=lambda x: x["seconds"]) for name, runs in results.items()}


def budget_figure(plt, best: dict, title: str):
    """Left: the streams' ITL step by step (dotted: a long prompt arrives); right: p50 / p99 of ITL and TTFT."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(best)
    for name, x in best.items():
        worst = {}
        for step, g in x["gaps"]:  # the slowest stream's gap of each step
            worst[step] = max(worst.get(step, 0), g)
        a.plot(list(worst), list(worst.values()), ".-", ms=3, lw=0.8, label=name, alpha=0.8)
    for step in next(iter(best.values()))["long_arrival_steps"]:
        a.axvline(step, color="grey", ls=":", lw=1)
    a.set(xlabel="engine step (dotted: a long prompt arrives)", ylabel="ITL of the running streams (ms)", yscale="log",
          title="the gaps a long prompt causes")
    a.legend(fontsize=8)
    width, xs = 0.2, range(len(names))
    for k, (metric, p, hatch) in enumerate([("itl_ms", "median", ""), ("itl_ms", "p99", "//"),
                                            ("ttft_ms", "median", ""), ("ttft_ms", "p99", "//")]):
        b.bar([x + (k - 1.5) * width for x in xs], [best[n][metric][p] for n in names], width, hatch=hatch,
              color="C0" if metric == "itl_ms" else "C1", edgecolor="white",
              label=f"{'stream ITL' if metric == 'itl_ms' else 'long prompt TTFT'} {p}")
    b.set_xticks(list(xs), [n.replace(" (", "\n(").replace(", ", ",\n") for n in names], fontsize=8)
    b.set(ylabel="ms", yscale="log", title="ITL of the streams vs TTFT of the long prompts")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()  # the title above the panels' own
    return fig


def prefill_budget(args, model, tokenizer) -> dict:
    n_out = args.output_len or 96
    best = budget_sweep(model, BUDGETS, stream_output=n_out, rounds=args.rounds, warmup=True)
    print(f"8 streams (32-token prompts, {n_out} tokens each) decoding; 1024-token prompts arrive at steps 8, 28, 48, 68; "
          f"least disturbed of {args.rounds} interleaved round(s) after an untimed warm-up round")
    print(f"{'':28s}{'stream ITL p50':>15s}{'p99':>9s}{'max':>9s}{'long TTFT p50':>15s}{'p99':>9s}{'seconds':>9s}{'steps':>7s}")
    for name, x in best.items():
        print(f"{name:28s}{x['itl_ms']['median']:12.0f} ms{x['itl_ms']['p99']:6.0f} ms{x['max_itl_ms']:6.0f} ms"
              f"{x['ttft_ms']['median']:12.0f} ms{x['ttft_ms']['p99']:6.0f} ms{x['seconds']:9.1f}{x['steps']:7d}")
    return {"best": best}, lambda plt: budget_figure(
        plt, best, f"8 streams decoding while 1024-token prompts arrive (least disturbed of {args.rounds} interleaved "
                   "round(s) after a warm-up)")


OVERLOAD_BLOCKS = 64  # overload's pool, in blocks of 16 tokens: far too small for its 24 requests at once


def overload_arrivals(vocab: int, n_out: int) -> list[tuple]:
    """overload's workload: 24 requests at step 0, prompts of 64-128 random tokens, n_out output tokens each."""
    rng = random.Random(1)
    return [(0, f"r{i}", random_prompt(rng, rng.randint(64, 128), vocab), n_out) for i in range(24)]


def overload(args, model, tokenizer) -> dict:
    num_blocks, n_out = OVERLOAD_BLOCKS, args.output_len or 96
    arrivals = overload_arrivals(model.config.vocab_size, n_out)
    engine = engine_for(model, num_blocks=num_blocks, block_size=16, enable_prefix_caching=False)
    records, trace = drive(engine, arrivals)
    usage = [row["blocks_used"] / num_blocks for row in trace]
    summary = {"num_blocks": num_blocks, "block_size": 16, "requests": len(arrivals), "steps": len(trace),
               "preemptions": trace[-1]["preemptions"], "peak_kv_usage": max(usage),
               "mean_kv_usage": sum(usage) / len(usage),
               "mean_kv_usage_while_waiting": _mean([u for u, row in zip(usage, trace) if row["waiting"]]),
               "token_fill_of_used_blocks": _mean([row["tokens_held"] / (row["blocks_used"] * 16)
                                                   for row in trace if row["blocks_used"]])}
    print(f"pool {num_blocks} blocks x 16 tokens, {len(arrivals)} requests of 64-128 + {n_out} tokens at once: "
          f"{summary['preemptions']} preemptions in {len(trace)} steps; KV usage peak {summary['peak_kv_usage']:.0%}, "
          f"mean {summary['mean_kv_usage']:.0%} ({summary['mean_kv_usage_while_waiting']:.0%} while requests waited); "
          f"used blocks {summary['token_fill_of_used_blocks']:.0%} filled with tokens")

    def figure(plt):
        fig, axes = plt.subplots(3, 1, figsize=(9, 6.5), sharex=True)
        t = [row["t"] for row in trace]
        axes[0].plot(t, [100 * u for u in usage]), axes[0].set_ylabel("KV blocks used (%)")
        axes[1].plot(t, [row["running"] for row in trace], label="running")
        axes[1].plot(t, [row["waiting"] for row in trace], label="waiting"), axes[1].legend()
        axes[1].set_ylabel("requests")
        axes[2].plot(t, [row["preemptions"] for row in trace]), axes[2].set_ylabel("preemptions (total)")
        axes[2].set_xlabel("s")
        axes[0].set_title(f"an overloaded pool: {num_blocks} blocks, {len(arrivals)} requests at once")
        return fig

    return {"summary": summary, "trace": trace}, figure


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def prefix_caching(args, model, tokenizer) -> dict:
    from nanoserve.bench.prompts import course_prompts
    from nanoserve.metrics import summarize

    items = course_prompts(16, seed=0, kinds=["system"])
    prompts = [tokenizer.encode_chat(item["messages"]) for item in items]
    n_out = args.output_len or 16
    arrivals = [(2 * i, f"r{i}", p, n_out) for i, p in enumerate(prompts)]  # one every 2 steps

    def measure(name, on, r):
        engine = engine_for(model, num_blocks=512, enable_prefix_caching=on)
        records, trace = drive(engine, arrivals)
        s = summarize(list(records.values()), trace[-1]["t"])
        stats = engine.block_manager.stats
        return {"ttft_ms": s["ttft_ms"], "output_throughput": s["output_throughput"], "seconds": trace[-1]["t"],
                "prompt_tokens": sum(map(len, prompts)), "prompt_tokens_computed": sum(map(len, prompts)) - stats.hit_tokens}

    results = interleaved(args.rounds, {"prefix caching on": True, "prefix caching off": False}, measure)
    best = {name: min(runs, key=lambda x: x["seconds"]) for name, runs in results.items()}
    print(f"16 requests sharing a system prompt (174 common tokens), one every 2 steps, {n_out} output tokens each")
    for name, x in best.items():
        print(f"  {name:20s} TTFT mean {x['ttft_ms']['mean']:7.0f} ms  median {x['ttft_ms']['median']:7.0f} ms  "
              f"{x['output_throughput']:6.1f} out tok/s  prompt tokens computed {x['prompt_tokens_computed']}/{x['prompt_tokens']}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(best)
        a.bar(names, [best[n]["ttft_ms"]["median"] for n in names]), a.set_ylabel("median TTFT (ms)")
        b.bar(names, [best[n]["prompt_tokens_computed"] for n in names]), b.set_ylabel("prompt tokens computed")
        fig.suptitle("a shared system prompt, prefix caching on / off")
        return fig

    return {"results": results, "best": best}, figure


BLOCK_SIZE_POOL = 64 << 20  # block-size's pool, in bytes: the same for every block size


def block_size(args, model, tokenizer, budget: int = BLOCK_SIZE_POOL) -> dict:
    """The same 64 MiB pool cut into blocks of 8, 16 or 32 tokens. For SmolLM2's float32 KV it is far too small for
    the 24 requests at once (the command prints both sizes), so the scheduler preempts, and how often depends on
    the block size: the rows differ in the tokens they compute, not only in their blocks."""
    from nanoserve.bench.offline import make_workload
    from nanoserve.metrics import summarize

    workload = make_workload(24, (20, 200), (16, args.output_len or 64), 0, model.config.vocab_size)
    arrivals = [(0, str(i), p, n) for i, (p, n) in enumerate(workload)]

    def measure(name, bs, r):
        engine = engine_for(model, block_size=bs, kv_cache_memory=budget, enable_prefix_caching=False)
        records, trace = drive(engine, arrivals)
        waste = [1 - row["tokens_held"] / (row["blocks_used"] * bs) for row in trace if row["blocks_used"]]
        s = summarize(list(records.values()), trace[-1]["t"])
        return {"output_throughput": s["output_throughput"], "tpot_ms": s["tpot_ms"]["median"],
                "mean_waste": _mean(waste), "seconds": trace[-1]["t"], "num_blocks": engine.block_manager.num_blocks,
                **{k: trace[-1][k] for k in ("preemptions", "recomputed_tokens", "computed_tokens")}}

    results = interleaved(args.rounds, {f"block {bs}": bs for bs in (8, 16, 32)}, measure)
    best = {name: max(runs, key=lambda x: x["output_throughput"]) for name, runs in results.items()}
    need = sum(len(p) + n for p, n in workload)
    print(f"24 requests (prompts 20-200, outputs 16-64) at once, {need} tokens at their ends; the same "
          f"{budget / 2**20:g} MiB pool")
    for name, x in best.items():
        rounds = " / ".join(f"{run['output_throughput']:.1f}" for run in results[name])
        print(f"  {name:9s} {x['output_throughput']:7.1f} out tok/s (best of {rounds})  median TPOT {x['tpot_ms']:6.1f} ms  "
              f"slots wasted in partly filled blocks {x['mean_waste']:.1%}")
        print(f"            {x['num_blocks']} blocks ({x['num_blocks'] * int(name.split()[1])} tokens): "
              f"{x['preemptions']} preemptions, {x['recomputed_tokens']} tokens recomputed, "
              f"{x['computed_tokens']} computed in all")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(best)
        a.bar(names, [best[n]["output_throughput"] for n in names]), a.set_ylabel("output tokens/s")
        b.bar(names, [100 * best[n]["mean_waste"] for n in names]), b.set_ylabel("KV slots wasted (%)")
        fig.suptitle("block size: speed vs waste")
        return fig

    return {"results": results, "best": best}, figure


def dtype(args, model, tokenizer) -> dict:
    from nanoserve.bench.offline import make_workload
    from nanoserve.metrics import summarize

    workload = make_workload(16, (32, 256), (args.output_len or 32,) * 2, 0, model.config.vocab_size)
    arrivals = [(0, str(i), p, n) for i, (p, n) in enumerate(workload)]
    models = {"float32": model, "bfloat16": _bf16_copy(model)}

    def measure(name, m, r):
        engine = engine_for(m, num_blocks=512, enable_prefix_caching=False)
        records, trace = drive(engine, arrivals)
        s = summarize(list(records.values()), trace[-1]["t"])
        return {"output_throughput": s["output_throughput"], "tpot_ms": s["tpot_ms"]["median"],
                "ttft_ms": s["ttft_ms"]["median"], "weights_bytes": sum(p.nbytes for p in m.parameters())}

    results = interleaved(args.rounds, models, measure)
    best = {name: max(runs, key=lambda x: x["output_throughput"]) for name, runs in results.items()}
    same = _greedy_agreement(models, workload[:4], 32)
    print(f"16 requests (prompts 32-256, {args.output_len or 32} tokens) at once")
    for name, x in best.items():
        print(f"  {name:9s} {x['output_throughput']:7.1f} out tok/s  median TPOT {x['tpot_ms']:6.1f} ms  "
              f"median TTFT {x['ttft_ms']:6.0f} ms  weights {x['weights_bytes'] / 2**20:.0f} MiB")
    print(f"  greedy tokens bfloat16 shares with float32 before the first difference: {same:.0%} (4 prompts x 32)")

    def figure(plt):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(best), [best[n]["output_throughput"] for n in best]), ax.set_ylabel("output tokens/s")
        ax.set_title("float32 vs bfloat16 on this CPU")
        return fig

    return {"results": results, "best": best, "greedy_agreement": same}, figure


def _bf16_copy(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def _greedy_agreement(models: dict, workload, n: int) -> float:
    """The share of bfloat16's greedy tokens that match float32's, up to each prompt's first difference."""
    outs = {}
    for name, m in models.items():
        engine = engine_for(m, num_blocks=256, enable_prefix_caching=False)
        for i, (p, _) in enumerate(workload):
            engine.add_request(str(i), p, greedy(n))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outs[name] = done
    a, b = outs.values()
    agree = 0
    for key in a:
        for x, y in zip(a[key], b[key]):
            if x != y:
                break
            agree += 1
    return agree / (n * len(a))


def concurrency(args, model, tokenizer) -> dict:
    """Each level C: max(4, 2C) requests of the prompt set, at most C in flight. The levels re-send the same
    prompts, so a prefix cache would answer a later level from an earlier one's blocks: the server this starts runs
    with its prefix cache off, and one given with --url must too (`serve --no-prefix-caching`). The levels are
    interleaved round by round (the order alternating); each keeps its round of the highest tokens/s."""
    from nanoserve.bench.serve import measure, serve_args

    server = None
    if args.url:
        url = args.url[0].split("=", 1)[-1]
        print(f"{url} must serve with its prefix cache off (nanoserve: serve --no-prefix-caching): the levels re-send "
              f"the same prompts")
    else:
        server, url = start_server(model, tokenizer, enable_prefix_caching=False)
    n_out = args.output_len or 32

    def one(c, _, r):
        result = measure(serve_args(url, num_prompts=max(4, 2 * c), max_concurrency=c, output_len=n_out,
                                    ignore_eos=True, no_progress=True), _metrics())
        print(f"  round {r + 1} {c:3d} clients: {result['output_throughput']:7.1f} out tok/s  TTFT p50 "
              f"{result['ttft_ms']['median']:7.0f} p99 {result['ttft_ms']['p99']:7.0f} ms  TPOT p50 "
              f"{result['tpot_ms']['median']:6.0f} ms", flush=True)
        return {"concurrency": c, **{k: result[k] for k in ("output_throughput", "request_throughput", "ttft_ms",
                                                             "tpot_ms", "itl_ms", "failed")}}

    try:
        results = interleaved(args.rounds, {c: c for c in args.concurrency}, one)
    finally:
        if server is not None:
            server.stop()
    runs = [max(results[c], key=lambda x: x["output_throughput"]) for c in args.concurrency]
    print(f"best of {args.rounds} interleaved round(s), by output tokens/s:")
    for x in runs:
        ttft, tpot = x["ttft_ms"], x["tpot_ms"]
        print(f"  {x['concurrency']:3d} clients: {x['output_throughput']:7.1f} out tok/s  {x['request_throughput']:5.2f} "
              f"req/s  TTFT mean / p50 / p90 / p99 {ttft['mean']:.0f} / {ttft['median']:.0f} / {ttft['p90']:.0f} / "
              f"{ttft['p99']:.0f} ms  TPOT mean / p50 / p99 {tpot['mean']:.0f} / {tpot['median']:.0f} / {tpot['p99']:.0f} ms",
              flush=True)

    def figure(plt):
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        cs = [r["concurrency"] for r in runs]
        axes[0].plot(cs, [r["output_throughput"] for r in runs], "o-"), axes[0].set_ylabel("output tokens/s")
        axes[1].plot(cs, [r["ttft_ms"]["median"] for r in runs], "o-", label="median")
        axes[1].plot(cs, [r["ttft_ms"]["p99"] for r in runs], "o--", label="p99"), axes[1].set_ylabel("TTFT (ms)")
        axes[2].plot(cs, [r["tpot_ms"]["median"] for r in runs], "o-", label="median")
        axes[2].plot(cs, [r["tpot_ms"]["p99"] for r in runs], "o--", label="p99"), axes[2].set_ylabel("TPOT (ms)")
        for ax in axes:
            ax.set_xscale("log", base=2), ax.set_xlabel("concurrent clients")
        axes[1].legend(), axes[2].legend()
        fig.suptitle(f"through HTTP, {n_out} output tokens per request, best of {args.rounds} interleaved round(s)")
        return fig

    return {"url": url, "results": results, "runs": runs}, figure


def start_server(model, tokenizer, **engine_config):
    """nanoserve's HTTP server in this process, on a free loopback port: (server, url)."""
    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.server.api_server import ServerConfig, ServerState
    from nanoserve.server.metrics import PrometheusStatLogger
    from nanoserve.server.runner import Server

    engine = engine_for(model, tokenizer, **{"num_blocks": 2048, **engine_config})
    stat_logger = PrometheusStatLogger("SmolLM2-135M-Instruct")
    state = ServerState(AsyncLLMEngine(engine, stat_logger), tokenizer, ServerConfig(), stat_logger)
    server = Server(state, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.start_in_thread()}"


def servers(args, model, tokenizer) -> dict:
    from nanoserve.bench.serve import measure, serve_args

    if not args.url or len(args.url) < 2:
        raise ValueError("servers needs two or more --url NAME=URL")
    urls = dict(u.split("=", 1) if "=" in u else (u, u) for u in args.url)
    n_out = args.output_len or 128

    def one(name, url, r):
        # round r's prompts are drawn with seed r: the systems of one round serve the same prompts, a system's
        # rounds different ones (so the spread between its rounds is not the machine's alone)
        result = measure(serve_args(url, num_prompts=args.num_prompts, max_concurrency=args.num_prompts,
                                    output_len=n_out, ignore_eos=True, no_progress=True, seed=r), _metrics())
        print(f"  round {r + 1} {name:12s} {result['output_throughput']:7.1f} out tok/s  TTFT p50 "
              f"{result['ttft_ms']['median']:7.0f} ms  TPOT p50 {result['tpot_ms']['median']:6.1f} ms  "
              f"failed {result['failed']}", flush=True)
        return {k: result[k] for k in ("output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "failed",
                                       "total_output_tokens", "output_lens")}

    results = interleaved(args.rounds, urls, one)
    best = {name: max(runs, key=lambda x: x["output_throughput"]) for name, runs in results.items()}
    first = next(iter(best))
    for name, x in best.items():
        print(f"{name:12s} best {x['output_throughput']:7.1f} out tok/s = {x['output_throughput'] / best[first]['output_throughput']:.2f}x {first}")

    def figure(plt):
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
        names = list(best)
        axes[0].bar(names, [best[n]["output_throughput"] for n in names]), axes[0].set_ylabel("output tokens/s")
        axes[1].bar(names, [best[n]["ttft_ms"]["median"] for n in names]), axes[1].set_ylabel("median TTFT (ms)")
        axes[2].bar(names, [best[n]["tpot_ms"]["median"] for n in names]), axes[2].set_ylabel("median TPOT (ms)")
        fig.suptitle(f"{args.num_prompts} concurrent clients x {n_out} tokens, best of {args.rounds} interleaved rounds")
        return fig

    return {"urls": urls, "results": results, "best": best}, figure


def _metrics():
    import importlib

    return importlib.import_module("nanoserve.metrics")


def scheduling(args, model, tokenizer):
    from nanoserve.bench.scheduling import scheduling as run_scheduling

    return run_scheduling(args, model, tokenizer)


RUNNERS = {"scheduling": scheduling, "chunked-prefill": chunked_prefill, "prefill-budget": prefill_budget, "overload": overload, "prefix-caching": prefix_caching,
           "block-size": block_size, "dtype": dtype, "concurrency": concurrency, "servers": servers,
           "routing": lambda *a: importlib.import_module("nanoserve.bench.routing").routing(*a),
           "kv-routing": lambda *a: importlib.import_module("nanoserve.bench.kv_routing").kv_routing(*a),
           "disagg-interference": lambda *a: importlib.import_module("nanoserve.bench.interference").disagg_interference(*a),
           "noisy-neighbour": lambda *a: importlib.import_module("nanoserve.bench.scheduling").noisy_neighbour(*a),
           "prefix-isolation": lambda *a: importlib.import_module("nanoserve.bench.isolation").prefix_isolation(*a),
           **{name: lambda *a, fn=fn: getattr(importlib.import_module("nanoserve.bench.kv_tiers"), fn)(*a)
              for name, fn in (("returning-users", "returning_users"), ("kv-crossover", "kv_crossover"),
                               ("kv-dtypes", "kv_dtypes"), ("swap-vs-recompute", "swap_vs_recompute"))},
           "sleep": lambda *a: importlib.import_module("nanoserve.bench.sleep").sleep_mode(*a)}


def run(args):
    import datetime
    import platform

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def refuse(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    unused = sorted(args.given - USES[args.name])
    if unused:
        flags = ", ".join("--" + f.replace("_", "-") for f in sorted(USES[args.name] | {"out_dir"}))
        return refuse(f"{args.name} does not use --{unused[0].replace('_', '-')} (its flags: {flags})")
    if args.name == "concurrency" and args.url and "threads" in args.given:
        return refuse("concurrency --url measures a server of its own: give --threads to that server, not here")
    if args.name == "concurrency" and args.url and len(args.url) > 1:
        return refuse("concurrency measures one server: give --url once")
    if args.rounds < 1:
        return refuse("--rounds must be >= 1")
    if args.output_len is not None and args.output_len < 1:
        return refuse("--output-len must be >= 1")
    if args.name in ("chunked-prefill", "prefill-budget") and args.output_len == 1:
        # these read the gaps between a stream's tokens: one token has none
        return refuse(f"{args.name} measures the gaps between each stream's tokens: --output-len must be >= 2")
    if args.name == "kv-routing" and (args.replicas < 2 or args.num_blocks < 1 or args.num_users < 1):
        return refuse("kv-routing needs --replicas >= 2, --num-blocks >= 1 and --num-users >= 1")
    if args.name == "disagg-interference" and (
            min(args.streams, args.long_prompts, args.long_len, *args.budgets, args.output_len or 1) < 1
            or not args.long_every > 0):
        return refuse("disagg-interference needs --streams, --long-prompts, --long-len, --budgets and --output-len "
                      ">= 1 and --long-every > 0")
    if args.workload is not None:
        workloads = importlib.import_module("nanoserve.bench.kv_routing").WORKLOADS
        if args.workload not in workloads:
            return refuse(f"--workload is one of {', '.join(workloads)}")
    if args.name == "servers" and (not args.url or len(args.url) < 2):
        return refuse("servers needs two or more --url NAME=URL")
    if args.threads:
        torch.set_num_threads(args.threads)
    from nanoserve.model import load_gguf
    from nanoserve.text.tokenizer import Tokenizer

    http_only = args.name in ("servers", "scheduling", "noisy-neighbour", "routing", "sleep", "disagg-interference") or (args.name == "concurrency" and args.url)  # scheduling: its own
    model, tokenizer = (None, None) if http_only else (load_gguf(), Tokenizer.from_gguf())
    if args.name in ("routing", "sleep", "disagg-interference"):  # the replicas, each served format (sleep) or the servers load the model
        model, tokenizer = None, Tokenizer.from_gguf()
    command = "python -m nanoserve bench experiment " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "experiment"] else [args.name])
    load_before = os.getloadavg()[0]
    print(f"command: {command}\nthreads: {torch.get_num_threads()}; load average {load_before:.1f}")
    try:
        result, figure = RUNNERS[args.name](args, model, tokenizer)
    except ValueError as e:  # what only the run finds wrong: e.g. a --url where nothing answers
        return refuse(str(e))
    load_after = os.getloadavg()[0]
    print(f"load average at the end: {load_after:.1f}")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, args.name)
    with open(path + ".json", "w") as f:
        json.dump({"experiment": args.name, "command": command, "threads": torch.get_num_threads(),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                   "load_average": [load_before, load_after], **result}, f, indent=1)
    fig = figure(plt)
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)
    plt.close(fig)
    print(f"wrote {path}.json and {path}.png")
