"""`python -m nanoserve bench experiment scheduling`: chapter 15's policies against one bursty two-tenant workload.

    batch        a 384-token prompt every 16 steps (15 requests), 32 output tokens, loose SLOs
    interactive  bursts of 6 16-token prompts every 12 steps, 16 output tokens (--output-len; batch: twice
                 that), tight SLOs; between steps 80 and 160 a rush: a burst of 12 every 6 steps (the server
                 is overloaded: not every SLO can be met)

The engine runs a tiny random-weight Llama (LlamaConfig.tiny, 4 layers, hidden 256; every request ignores EOS)
with a 128-token step budget (chunked prefill) and a pool of 96 blocks of 16 tokens (1,536 tokens: four batch
requests fill it, so the pool runs short and sequences are preempted). Why not SmolLM2: the point is the
scheduler's decisions, and on the shared 2-core machine one full SmolLM2 step took 6.9 s under load, hours
for this workload. The SLOs are set in units of one measured full-budget step (`step_ms`, timed before the
runs), so they mean the same for a fast and a slow model: interactive TTFT 4 steps, TPOT 2 steps; batch TTFT
80 steps, TPOT 6 steps. Arrivals are at engine steps (as every offline experiment here), the same for every
policy; policies run interleaved, in alternating order, `--rounds` times (the chapter uses 3); the table gives each
figure's median over the rounds and its range, and a difference counts only where the ranges do not overlap.

A request meets its SLO when both its TTFT and TPOT are within its tenant's targets; goodput = such requests
per second. Rejected = refused by --slo-reject. Recomputed = the computed tokens preemption threw away (no
prefix cache here: all of them are computed again), as a share of every token computed.
"""

import random
import sys
import time

from nanoserve.engine.policies import SLOTargets

POLICY_RUNS = {"fcfs": dict(scheduling_policy="fcfs"), "priority": dict(scheduling_policy="priority"),
               "slo": dict(scheduling_policy="slo"), "slo + reject": dict(scheduling_policy="slo", slo_reject=True),
               "fair": dict(scheduling_policy="fair")}
BUDGET, NUM_BLOCKS, BLOCK_SIZE = 128, 96, 16
# tenant -> (TTFT, TPOT) targets in steps of `step_ms`
TARGETS_IN_STEPS = {"interactive": (4.0, 2.0), "batch": (80.0, 6.0)}


def workload(vocab: int, n_out: int = 16) -> list[tuple]:
    """[(step, id, prompt ids, output tokens, {"tenant": ..., "priority": ...})]: the same for every policy."""
    from nanoserve.bench.experiment import random_prompt

    rng = random.Random(15)
    arrivals = [(16 * i, f"batch{i}", random_prompt(rng, 384, vocab), 2 * n_out, {"tenant": "batch", "priority": 1})
                for i in range(15)]
    bursts = [(step, 6) for step in range(0, 80, 12)] + [(step, 12) for step in range(80, 160, 6)] + \
             [(step, 6) for step in range(160, 240, 12)]
    for step, size in bursts:
        arrivals += [(step, f"chat{step}-{i}", random_prompt(rng, 16, vocab), n_out,
                      {"tenant": "interactive", "priority": 0}) for i in range(size)]
    return arrivals


def full_step_ms(model) -> float:
    """The median time of one engine step computing a full budget of prompt tokens (5 tries, after a warm-up)."""
    from nanoserve.bench.experiment import engine_for, greedy

    engine = engine_for(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                        enable_prefix_caching=False)
    times = []
    for i in range(6):
        engine.add_request(f"cal{i}", list(range(100 + i, 100 + i + BUDGET)), greedy(1))
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1000)
    return sorted(times[1:])[2]


def summarize_run(records: dict, trace: list, tenants: dict, slos: dict) -> dict:
    """Per policy: TTFT / TPOT p50 / p99 (ms) per tenant, goodput, % meeting SLO, rejected %, preemptions and the
    tokens they threw away, KV use, tokens/s."""
    from nanoserve.metrics import meets_slos, percentile, request_latencies

    duration = trace[-1]["t"]
    lat = {rid: request_latencies(r) for rid, r in records.items()}
    met = {rid: records[rid].success and meets_slos(lat[rid], slos[tenants[rid]]) for rid in records}
    row = {"goodput": sum(met.values()) / duration, "met_pct": 100 * sum(met.values()) / len(records),
           "rejected_pct": 100 * sum(not r.success for r in records.values()) / len(records),
           "kv_util_pct": 100 * sum(t["blocks_used"] / t["num_blocks"] for t in trace) / len(trace),
           "throughput": sum(r.output_tokens for r in records.values() if r.success) / duration,
           "seconds": duration, "steps": len(trace), "preemptions": trace[-1]["preemptions"],
           "recomputed_tokens": trace[-1]["recomputed_tokens"],
           "recomputed_pct": 100 * trace[-1]["recomputed_tokens"] / trace[-1]["computed_tokens"]}
    for tenant in ("interactive", "batch"):
        mine = [rid for rid in records if tenants[rid] == tenant and records[rid].success]
        row[f"{tenant}_met_pct"] = 100 * sum(met[rid] for rid in mine) / sum(t == tenant for t in tenants.values())
        for name in ("ttft", "tpot"):
            values = [lat[rid][name] * 1000 for rid in mine if lat[rid][name] is not None]
            for p in (50, 99):
                row[f"{tenant}_{name}_p{p}_ms"] = percentile(values, p) if values else None
    return row


def median_and_range(runs: list[dict]) -> dict:
    """{key: (median, min, max)} over the rounds (None where a round had no value)."""
    out = {}
    for key in runs[0]:
        values = sorted(r[key] for r in runs if r[key] is not None)
        out[key] = (values[len(values) // 2], values[0], values[-1]) if values else None
    return out


def print_summary(summary: dict, cols: list[tuple[str, str]], rounds: int) -> None:
    """The table of median [min-max] per policy and column (`summary`: median_and_range's, by policy)."""
    print(f"median [min-max] over {rounds} interleaved rounds")
    print(f"{'policy':14s}" + "".join(f"{label:>21s}" for _, label in cols))
    for name, row in summary.items():
        print(f"{name:14s}" + "".join(f"{'-' if row[k] is None else '{:.1f} [{:.1f}-{:.1f}]'.format(*row[k]):>21s}"
                                      for k, _ in cols))


def tiny_model():
    import torch

    from nanoserve.model import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  max_position_embeddings=1024)).eval()


def scheduling(args, model, tokenizer):
    from nanoserve.bench.experiment import drive, engine_for, interleaved

    model = tiny_model()
    arrivals = workload(model.config.vocab_size, args.output_len or 16)
    tenants = {a[1]: a[4]["tenant"] for a in arrivals}
    step_ms = full_step_ms(model)
    slos = {t: {"ttft": ttft * step_ms / 1000, "tpot": tpot * step_ms / 1000} for t, (ttft, tpot) in TARGETS_IN_STEPS.items()}
    tenant_slos = {t: SLOTargets(ttft * step_ms, tpot * step_ms) for t, (ttft, tpot) in TARGETS_IN_STEPS.items()}
    print(f"one full step ({BUDGET} tokens): {step_ms:.1f} ms; interactive SLO: TTFT {slos['interactive']['ttft'] * 1000:.0f} ms, "
          f"TPOT {slos['interactive']['tpot'] * 1000:.0f} ms; batch: TTFT {slos['batch']['ttft'] * 1000:.0f} ms, "
          f"TPOT {slos['batch']['tpot'] * 1000:.0f} ms; {len(arrivals)} requests", file=sys.stderr)

    def measure(name, config, r):
        engine = engine_for(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                            enable_prefix_caching=False, **config,
                            **({"tenant_slos": tenant_slos} if config["scheduling_policy"] == "slo" else {}))
        records, trace = drive(engine, arrivals)
        assert engine.block_manager.get_num_free_blocks() == NUM_BLOCKS  # every block back
        row = summarize_run(records, trace, tenants, slos)
        print(f"  {name}: goodput {row['goodput']:.2f}/s, chat met {row['interactive_met_pct']:.1f} %, rejected "
              f"{row['rejected_pct']:.1f} %, {row['preemptions']} preemptions, {row['recomputed_pct']:.1f} % recomputed, "
              f"{row['seconds']:.1f} s", file=sys.stderr, flush=True)
        return row

    rounds = args.rounds
    results = interleaved(rounds, POLICY_RUNS, measure)
    summary = {name: median_and_range(runs) for name, runs in results.items()}
    cols = [("interactive_ttft_p50_ms", "chat TTFT p50"), ("interactive_ttft_p99_ms", "p99"),
            ("interactive_met_pct", "chat met %"), ("batch_met_pct", "batch met %"), ("goodput", "goodput/s"),
            ("rejected_pct", "rejected %"), ("preemptions", "preempt"), ("recomputed_pct", "recomp. %"),
            ("throughput", "tok/s"), ("seconds", "run s")]
    print_summary(summary, cols, rounds)

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(summary)
        for ax, key, title in ((a, "interactive_met_pct", "interactive requests meeting their SLO (%)"),
                               (b, "goodput", "goodput (requests meeting their SLO per s)")):
            med = [summary[n][key][0] for n in names]
            err = [[m - summary[n][key][1] for n, m in zip(names, med)], [summary[n][key][2] - m for n, m in zip(names, med)]]
            ax.bar(names, med, yerr=err, capsize=4, color="tab:green" if key == "goodput" else "tab:blue")
            ax.set(title=title)
            ax.tick_params(axis="x", rotation=20)
        fig.suptitle(f"a bursty two-tenant workload, tiny Llama on this CPU (one full step = {step_ms:.0f} ms); "
                     f"median and range of {rounds} rounds")
        return fig

    return {"step_ms": step_ms, "slos_s": slos, "rounds": rounds,
            "workload": [(a[0], a[1], len(a[2]), a[3], a[4]) for a in arrivals],
            "results": results, "summary": summary}, figure


# ---- the noisy neighbour: one tenant floods, another sends a few short requests --------------------------------

NOISY_SEATS, NOISY_BUDGET = 32, 256  # max_num_seqs and the step's token budget of the noisy-neighbour engine


def noisy_workload(vocab: int) -> list[tuple]:
    """flood: 128 requests at step 0 (32-token prompts, 64 output tokens: four times the engine's 32 seats);
    victim: 8 short requests (4-token prompts, 2 output tokens), one every 10 steps from step 10."""
    from nanoserve.bench.experiment import random_prompt

    rng = random.Random(8)
    arrivals = [(0, f"flood{i}", random_prompt(rng, 32, vocab), 64, {"tenant": "flood"}) for i in range(128)]
    arrivals += [(10 * (i + 1), f"victim{i}", random_prompt(rng, 4, vocab), 2, {"tenant": "victim"}) for i in range(8)]
    return arrivals


def noisy_neighbour(args, model, tokenizer):
    """The victim's TTFT while another tenant floods, under `priority` (the default without tenants: first come,
    first served within a priority) and `fair` (serve's default with --api-keys)."""
    from nanoserve.bench.experiment import drive, engine_for, interleaved
    from nanoserve.metrics import percentile, request_latencies

    model = tiny_model()
    arrivals = noisy_workload(model.config.vocab_size)
    policies = {"priority": "priority", "fair": "fair"}

    def measure(name, policy, r):
        engine = engine_for(model, num_blocks=NUM_BLOCKS * 4, block_size=BLOCK_SIZE, max_num_seqs=NOISY_SEATS,
                            max_num_batched_tokens=NOISY_BUDGET, enable_prefix_caching=False, scheduling_policy=policy)
        records, trace = drive(engine, arrivals)
        ttft = {rid: request_latencies(rec)["ttft"] * 1000 for rid, rec in records.items()}
        victim = [ttft[rid] for rid in ttft if rid.startswith("victim")]
        flood = [ttft[rid] for rid in ttft if rid.startswith("flood")]
        step_ms = percentile([t["step_ms"] for t in trace], 50)
        return {"victim_ttft_p50_ms": percentile(victim, 50), "victim_ttft_p99_ms": percentile(victim, 99),
                "flood_ttft_p50_ms": percentile(flood, 50), "step_ms_p50": step_ms,
                "victim_ttft_p50_steps": percentile(victim, 50) / step_ms, "seconds": trace[-1]["t"]}

    results = interleaved(args.rounds, policies, measure)
    summary = {name: median_and_range(runs) for name, runs in results.items()}
    # "steps": the victim's TTFT p50 over the run's median step time, an estimate, not a count of steps
    cols = [("victim_ttft_p50_ms", "victim TTFT p50"), ("victim_ttft_p99_ms", "p99"),
            ("victim_ttft_p50_steps", "p50 / median step"), ("flood_ttft_p50_ms", "flood TTFT p50"),
            ("seconds", "run s")]
    print_summary(summary, cols, args.rounds)

    def figure(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(summary)
        med = [summary[n]["victim_ttft_p50_ms"][0] for n in names]
        err = [[m - summary[n]["victim_ttft_p50_ms"][1] for n, m in zip(names, med)],
               [summary[n]["victim_ttft_p50_ms"][2] - m for n, m in zip(names, med)]]
        ax.bar(names, med, yerr=err, capsize=4, color="tab:blue")
        ax.set(ylabel="ms", title=f"the victim's TTFT p50 while another tenant floods (tiny Llama), "
                                  f"median and range of {args.rounds} rounds")
        return fig

    return {"workload": {"flood": "128 x (32 prompt, 64 out) at step 0", "victim": "8 x (4 prompt, 2 out), every 10 steps",
                         "max_num_seqs": NOISY_SEATS, "max_num_batched_tokens": NOISY_BUDGET},
            "results": results, "summary": summary}, figure
