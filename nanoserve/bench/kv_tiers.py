"""Chapter 18's measurements, run through `python -m nanoserve bench experiment NAME` (experiment.py's harness).

  returning-users  users with long system prompts, more than the pool holds, each returning after the others:
                   no tier vs the file tier vs an int8 pool in the same bytes — prefix hits per tier, TTFT
                   p50 / p99, and whether the greedy text is the no-tier text
  kv-crossover     what recomputing n prompt tokens costs (a lone prefill of n tokens) and what loading them
                   from the file tier costs (n / 16 blocks read back into the pool), measured here; the
                   crossover, and the load-or-recompute map over prompt length x tier bandwidth
  kv-dtypes        per KV dtype (fp32, bf16, int8, fp8): blocks in 1 GiB and 2,000-token sequences that fit,
                   the pool's bytes beside chapter 04's formula; the logit error on heldout text (chapter 10's
                   method: one prefill through a pool of that dtype against float32 without a cache)
  swap-vs-recompute  chapter 09's overload workload (24 requests at once, a pool of 64 blocks), preempting by
                   recompute and by swap to the file tier: preemptions, tokens recomputed, blocks swapped and
                   bytes moved, TTFT / TPOT p50 / p99, output tokens/s, and whether the greedy text is the same
"""

import random
import sys
import time

import torch

from nanoserve.bench.experiment import drive, engine_for, interleaved, random_prompt


RETURNING_PROMPT_LEN = 192  # returning-users: each user's own system prompt, 12 blocks of 16


def returning_visits(users: int, vocab: int, n_out: int, visits: int = 3) -> list[tuple]:
    """returning-users' arrivals for drive(): visit v of user u is u's own system prompt + a new 8-token question,
    n_out output tokens, alone (each arrives after the previous one's n_out + 1 steps); users take turns, so each
    returns after all the others."""
    rng = random.Random(0)
    systems = [random_prompt(rng, RETURNING_PROMPT_LEN, vocab) for _ in range(users)]
    return [((v * users + u) * (n_out + 1), f"u{u}v{v}", systems[u] + random_prompt(rng, 8, vocab), n_out)
            for v in range(visits) for u in range(users)]


def returning_users(args, model, tokenizer) -> dict:
    from nanoserve.memory import kv_bytes_per_token
    from nanoserve.metrics import stats, ttft

    users, prompt_len, visits, n_out = args.num_users, RETURNING_PROMPT_LEN, 3, args.output_len or 8
    arrivals = returning_visits(users, model.config.vocab_size, n_out, visits)
    block_bytes = 16 * kv_bytes_per_token(model.config, "fp32")
    pool_bytes = int(block_bytes * (prompt_len // 16 + 1) * max(users // 3, 1))  # users // 3 users' prompts (at least 1)
    systems_ = {"no tier": dict(), "file tier": dict(kv_tier_blocks=users * (prompt_len // 16 + 2)),
                "int8 pool": dict(kv_cache_dtype="int8")}

    def measure(name, extra, r):
        engine = Recording(engine_for(model, kv_cache_memory=pool_bytes, **extra))
        try:
            records, trace = drive(engine, arrivals)
            tier = engine.kv_tier_stats() or {}
        finally:
            engine.close()
        bm = engine.block_manager
        later = [rid for rid in records if not rid.endswith("v0")]  # returning visits
        queried = bm.stats.queried_tokens
        tier_hits = tier.get("tier_hit_tokens", 0)
        return {"num_blocks": bm.num_blocks, "pool_hit_rate": (bm.stats.hit_tokens - tier_hits) / queried,
                "tier_hit_rate": tier_hits / queried, "tier": tier,
                "ttft_ms": stats([ttft(records[i].start, records[i].chunk_times) * 1000 for i in later]),
                "seconds": trace[-1]["t"], "texts": engine.token_ids}

    results = interleaved(args.rounds, systems_, measure)
    best = {name: min(runs, key=lambda x: x["seconds"]) for name, runs in results.items()}
    base = dict(best["no tier"]["texts"])
    print(f"{users} users, {prompt_len}-token system prompts, {visits} visits each, a pool of "
          f"{pool_bytes / 2**20:.1f} MiB; TTFT of the returning visits")
    for name, x in best.items():
        texts = x.pop("texts")
        x["same_text_as_no_tier"] = sum(texts[k] == base[k] for k in base) / len(base)
        t = x["ttft_ms"]
        # tokens the tier held that load_policy chose to compute again (section 3: decided by the measured rates)
        recomputed = f" (+{x['tier']['tier_recomputed_tokens']} tokens recomputed)" if x["tier"] else ""
        print(f"  {name:10s} {x['num_blocks']:4d} blocks  hits: pool {x['pool_hit_rate']:5.1%}  tier "
              f"{x['tier_hit_rate']:5.1%}{recomputed}   TTFT p50 {t['median']:7.0f} ms  p99 {t['p99']:7.0f} ms   "
              f"same text as no tier {x['same_text_as_no_tier']:.0%}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        names = list(best)
        a.bar(names, [best[n]["pool_hit_rate"] for n in names], label="pool")
        a.bar(names, [best[n]["tier_hit_rate"] for n in names], bottom=[best[n]["pool_hit_rate"] for n in names],
              label="file tier")
        a.set(ylabel="prompt tokens found", title="prefix hits per tier"), a.legend()
        for k, key in enumerate(("median", "p99")):
            b.bar([i + 0.4 * k for i in range(len(names))], [best[n]["ttft_ms"][key] for n in names], 0.4, label=key)
        b.set_xticks([i + 0.2 for i in range(len(names))], names)
        b.set(ylabel="TTFT of returning visits (ms)", title="time to first token"), b.legend()
        return fig

    return {"results": results, "best": best, "pool_bytes": pool_bytes}, figure


class Recording:
    """An engine that also keeps each finished request's greedy token ids (to compare the systems' texts)."""

    def __init__(self, engine):
        self.engine, self.token_ids = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        outputs = self.engine.step()
        self.token_ids.update({o.request_id: o.token_ids for o in outputs if o.finished})
        return outputs


def kv_crossover(args, model, tokenizer) -> dict:
    from nanoserve.kv.file_tier import FileKVTier, block_nbytes
    from nanoserve.kv.load_policy import should_load
    from nanoserve.kv.paged_attention import PagedKVCache
    from nanoserve.kv.rates import LineFit
    from nanoserve.metrics import ttft

    lengths, bs, rng = [16, 64, 256, 1024], 16, random.Random(0)
    c = model.config
    # recompute: a lone prompt of n tokens, no prefix cache, to its first token (its prefill)
    prefill = {n: [] for n in lengths}
    engine = engine_for(model, num_blocks=2 * max(lengths) // bs, enable_prefix_caching=False)
    # load: n / 16 blocks of a SmolLM2-shaped float32 pool written to the file tier, then read back
    pool = PagedKVCache(c.num_hidden_layers, 2 * max(lengths) // bs, bs, c.num_key_value_heads, c.head_dim)
    tier = FileKVTier(max(lengths) // bs, block_nbytes(pool))
    load = {n: [] for n in lengths}
    try:
        for r in range(max(args.rounds, 2)):  # round 0 warms up; the best of the others is kept
            for n in lengths:
                records, _ = drive(engine, [(0, f"p{n}", random_prompt(rng, n, c.vocab_size), 1)])
                prefill[n].append(ttft(records[f"p{n}"].start, records[f"p{n}"].chunk_times))
                k = n // bs
                tier.apply(pool, [("offload", b, b) for b in range(k)])
                tier.flush()
                start = time.perf_counter()
                tier.apply(pool, [("load", b, k + b) for b in range(k)])
                load[n].append(time.perf_counter() - start)
            print(f"  round {r + 1}: done", file=sys.stderr, flush=True)
    finally:
        tier.close()
    recompute_s = {n: min(v[1:]) for n, v in prefill.items()}
    load_s = {n: min(v[1:]) for n, v in load.items()}
    fits = {}
    for name, points in (("recompute", recompute_s), ("load", load_s)):
        fit = LineFit()
        for n, s in points.items():
            fit.add(n, s)
        fits[name] = fit.fit()
    bytes_per_token = tier.block_nbytes / bs
    prefill_rate = fits["recompute"][1]
    tier_bw, latency = bytes_per_token / fits["load"][1], max(fits["load"][0], 0.0)
    print(f"bytes per token {bytes_per_token:,.0f} (float32 pool); the file tier read back (page cache warm)")
    print(f"{'tokens':>8s} {'recompute ms':>14s} {'load ms':>10s}")
    for n in lengths:
        print(f"{n:8d} {recompute_s[n] * 1000:14.2f} {load_s[n] * 1000:10.2f}")
    crossover_bw = bytes_per_token / prefill_rate  # B*: below it loading never pays, whatever the length
    print(f"fit: recompute {prefill_rate * 1e3:.3f} ms / token; load {latency * 1e3:.3f} ms + "
          f"{tier_bw / 1e9:.2f} GB/s; loading pays above {crossover_bw / 1e6:.1f} MB/s of tier bandwidth")
    print(f"this tier: {tier_bw / crossover_bw:.1f}x that crossover, so "
          + ("loading pays beyond the fixed latency" if tier_bw > crossover_bw else "recomputing wins at every length"))

    def figure(plt):
        import numpy as np

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        a.loglog(lengths, [recompute_s[n] * 1000 for n in lengths], "o-", label="recompute (prefill, measured)")
        a.loglog(lengths, [load_s[n] * 1000 for n in lengths], "s-", label="load from the file tier (measured)")
        for bw in (1e8, 1e7):
            a.loglog(lengths, [(latency + n * bytes_per_token / bw) * 1000 for n in lengths], ":",
                     label=f"load at {bw / 1e6:.0f} MB/s (modelled)")
        a.set(xlabel="prefix tokens", ylabel="ms", title="recompute vs load"), a.legend(fontsize=8)
        ns, bws = np.logspace(0, 4, 60), np.logspace(np.log10(crossover_bw) - 2, 11, 60)
        grid = [[should_load(int(n), bytes_per_token, prefill_rate, bw, latency) for n in ns] for bw in bws]
        b.pcolormesh(ns, bws, np.array(grid, dtype=float), cmap="RdYlGn", shading="auto", vmin=0, vmax=1)
        b.axhline(tier_bw, color="k", ls="--", label=f"this file tier ({tier_bw / 1e6:.0f} MB/s)")
        b.axhline(crossover_bw, color="w", ls=":", label=f"crossover ({crossover_bw / 1e6:.2f} MB/s)")
        b.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="tier bandwidth (B/s)",
              title="load (green) or recompute (red)"), b.legend(fontsize=8)
        return fig

    return {"lengths": lengths, "recompute_s": recompute_s, "load_s": load_s, "bytes_per_token": bytes_per_token,
            "prefill_s_per_token": prefill_rate, "tier_bytes_per_s": tier_bw, "load_latency_s": latency}, figure


def kv_dtypes(args, model, tokenizer) -> dict:
    from nanoserve.bench.quality import HELDOUT
    from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache, num_blocks_for_budget
    from nanoserve.kv.quantized_pool import (KV_QUANT_DTYPES, QuantizedKVCache, QuantizedPagedAttention,
                                             quantized_block_bytes)
    from nanoserve.memory import GiB, kv_bytes_per_token

    c, bs, seq_len = model.config, 16, 2000
    ids = torch.tensor(tokenizer.encode(HELDOUT.read_text()))[:512]
    with torch.inference_mode():
        ref = model.compute_logits(model(ids))  # float32, no cache: the oracle
    plain = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = {}
    for name in ("fp32", "bf16", "int8", "fp8"):
        formula = int(GiB // (bs * kv_bytes_per_token(c, "int8" if name == "fp8" else name)))
        if name in plain:
            blocks = num_blocks_for_budget(c, GiB, bs, plain[name])
            pool = PagedKVCache(c.num_hidden_layers, 64, bs, c.num_key_value_heads, c.head_dim, plain[name])
            attention = PagedAttention
        else:
            blocks = int(GiB // quantized_block_bytes(c, bs))
            pool = QuantizedKVCache(c.num_hidden_layers, 64, bs, c.num_key_value_heads, c.head_dim, KV_QUANT_DTYPES[name])
            attention = QuantizedPagedAttention
        metadata = AttentionMetadata.build([list(range(len(ids) // bs + 1))], [len(ids)], [len(ids)], bs)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, torch.arange(len(ids)), attention(pool, metadata)))
        d = (logits.float() - ref).abs()
        rows[name] = {"blocks_per_gib": blocks, "formula_blocks_per_gib": formula,
                      "sequences_of_2000": blocks // -(-seq_len // bs), "max_dlogit": d.max().item(),
                      "mean_dlogit": d.mean().item(), "top1": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    print(f"SmolLM2, blocks of {bs}, 1 GiB; logits of {len(ids)} heldout tokens through a pool of each dtype vs float32")
    print(f"{'dtype':6s} {'blocks':>7s} {'formula':>8s} {'2000-tok seqs':>14s} {'max |dlogit|':>13s} {'mean':>7s} {'top-1':>7s}")
    for name, x in rows.items():
        print(f"{name:6s} {x['blocks_per_gib']:7d} {x['formula_blocks_per_gib']:8d} {x['sequences_of_2000']:14d} "
              f"{x['max_dlogit']:13.3f} {x['mean_dlogit']:7.4f} {x['top1']:7.2%}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(rows)
        a.bar(names, [rows[n]["blocks_per_gib"] for n in names]), a.set(ylabel="blocks of 16 in 1 GiB")
        b.bar(names, [rows[n]["max_dlogit"] for n in names]), b.set(ylabel="max |Δlogit| vs float32")
        return fig

    return {"rows": rows, "tokens": len(ids)}, figure


def swap_vs_recompute(args, model, tokenizer) -> dict:
    from nanoserve.bench.experiment import OVERLOAD_BLOCKS, overload_arrivals

    n_out = args.output_len or 96
    arrivals = overload_arrivals(model.config.vocab_size, n_out)
    best = compare_preemption_modes(model, arrivals, OVERLOAD_BLOCKS, 16, args.rounds)
    print(f"{len(arrivals)} requests of 64-128 + {n_out} tokens at once, a pool of {OVERLOAD_BLOCKS} blocks x 16 "
          f"tokens, prefix caching off; the fastest of {args.rounds} interleaved round(s)")
    print(f"{'':10s}{'preempt':>8s}{'recomputed':>11s}{'blocks out / swap-ins':>22s}{'fallbacks':>10s}{'MB moved':>9s}"
          f"{'TTFT p50':>11s}{'p99':>9s}{'TPOT p50':>11s}{'p99':>9s}{'out tok/s':>10s}{'same text':>10s}")
    for name, x in best.items():
        print(f"{name:10s}{x['preemptions']:8d}{x['recomputed_tokens']:11d}"
              f"{x['swapped_out_blocks']:15d} / {x['swap_ins']:<4d}{x['swap_fallbacks']:10d}"
              f"{(x['bytes_written'] + x['bytes_read']) / 1e6:9.1f}{x['ttft_ms']['median']:8.0f} ms"
              f"{x['ttft_ms']['p99']:6.0f} ms{x['tpot_ms']['median']:8.0f} ms{x['tpot_ms']['p99']:6.0f} ms"
              f"{x['output_throughput']:10.1f}{x['same_text_as_recompute']:10.0%}")
    for name, x in best.items():  # the spread between rounds: what a difference between the modes must exceed
        print(f"{name:10s}every round: " + ", ".join(f"{r['seconds']:.1f} s = {r['output_throughput']:.1f} out tok/s"
                                                  for r in x["rounds"]))

    def figure(plt):
        fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
        names = list(best)
        for ax, (key, label) in zip(axes, [("recomputed_tokens", "tokens recomputed"), ("ttft_p99", "TTFT p99 (ms)"),
                                           ("tpot_p99", "TPOT p99 (ms)"), ("output_throughput", "output tokens/s")]):
            value = {"ttft_p99": lambda x: x["ttft_ms"]["p99"], "tpot_p99": lambda x: x["tpot_ms"]["p99"]}.get(
                key, lambda x: x[key])
            ax.bar(names, [value(best[n]) for n in names]), ax.set_ylabel(label)
        fig.suptitle(f"preemption by recompute vs by swap: {len(arrivals)} requests, a pool of {OVERLOAD_BLOCKS} blocks")
        return fig

    return {"best": best, "num_blocks": OVERLOAD_BLOCKS, "output_len": n_out}, figure


def compare_preemption_modes(model, arrivals: list[tuple], num_blocks: int, block_size: int, rounds: int) -> dict:
    """Serve drive()'s `arrivals` on a pool of num_blocks, prefix caching off, preempting by recompute and by swap,
    interleaved over `rounds`: {mode: the fastest round's counts and latencies, and "rounds": every round's seconds
    and output tokens/s}. The swap tier has a slot for every
    block the requests can ever hold, so no preemption falls back for want of room (and the count says so).

    Tokens recomputed are counted, not estimated: every request computes each of its prompt + output - 1 tokens
    once (the last output token is sampled, never computed), so anything the steps computed beyond that sum was
    computed again."""
    from nanoserve.metrics import summarize

    slots = sum(-(-(len(prompt) + n) // block_size) for _, _, prompt, n, *_ in arrivals)
    needed = sum(len(prompt) + n - 1 for _, _, prompt, n, *_ in arrivals)
    modes = {"recompute": dict(), "swap": dict(preemption_mode="swap", kv_tier_blocks=max(slots, 2))}

    def measure(name, extra, r):
        engine = Recording(engine_for(model, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False,
                                      **extra))
        try:
            records, trace = drive(engine, arrivals)
            tier = engine.kv_tier_stats() or {}
        finally:
            engine.close()
        s = summarize(list(records.values()), trace[-1]["t"])
        return {"preemptions": trace[-1]["preemptions"], "recomputed_tokens": trace[-1]["computed_tokens"] - needed,
                **{k: tier.get(k, 0) for k in ("swapped_out_blocks", "swap_ins", "swap_fallbacks", "bytes_written",
                                               "bytes_read")},
                "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "output_throughput": s["output_throughput"],
                "seconds": trace[-1]["t"], "steps": len(trace), "texts": engine.token_ids}

    results = interleaved(rounds, modes, measure)
    best = {name: min(runs, key=lambda x: x["seconds"]) for name, runs in results.items()}
    base = best["recompute"]["texts"]
    for name, x in best.items():
        x["rounds"] = [{k: r[k] for k in ("seconds", "output_throughput")} for r in results[name]]
        texts = x.pop("texts")
        x["same_text_as_recompute"] = sum(texts[k] == base[k] for k in base) / len(base)
    return best
