"""`python -m nanoserve bench experiment scheduling`: chapter 15's policies against one bursty two-tenant workload.

    interactive  3 bursts of 8 requests (steps 3, 12, 24): 16-token prompts, 8 output tokens, tight SLOs
    batch        6 requests at step 0: 384-token prompts, 8 output tokens, loose SLOs

The engine runs a tiny random-weight Llama (LlamaConfig.tiny, 4 layers, hidden 256; every request ignores EOS)
with a 128-token step budget (chunked prefill), so the batch tenant's prompts keep the budget full for ~18
steps: whoever is served first decides the interactive TTFT. Why not SmolLM2: the point is the scheduler's
decisions, and on the shared 2-core machine one full SmolLM2 step took 6.9 s under load, i.e. over 10 minutes
a policy; the tiny model keeps the whole experiment to about a minute. The SLOs are set in units of one
measured full-budget step (`step_ms`, timed before the runs), so they mean the same for a fast and a slow
model: interactive TTFT 3 steps, TPOT 1.5 steps; batch TTFT 60 steps, TPOT 5 steps.
Arrivals are at engine steps (as every offline experiment here), the same for every policy; policies run
interleaved, `--rounds` times, and each keeps its round with the highest goodput.

A request meets its SLO when both its TTFT and TPOT are within its tenant's targets; goodput = such requests
per second. Rejected = refused by --slo-reject. Nothing times out here (no client deadline in an offline run).
"""

import random
import sys
import time

from nanoserve.engine.policies import SLOTargets

POLICY_RUNS = {"fcfs": dict(scheduling_policy="fcfs"), "priority": dict(scheduling_policy="priority"),
               "slo": dict(scheduling_policy="slo"), "slo + reject": dict(scheduling_policy="slo", slo_reject=True),
               "fair": dict(scheduling_policy="fair")}
BUDGET, NUM_BLOCKS, BLOCK_SIZE = 128, 192, 16
# tenant -> (TTFT, TPOT) targets in steps of `step_ms`
TARGETS_IN_STEPS = {"interactive": (3.0, 1.5), "batch": (60.0, 5.0)}


def workload(vocab: int, n_out: int) -> list[tuple]:
    """[(step, id, prompt ids, output tokens, {"tenant": ..., "priority": ...})]: the same for every policy."""
    from nanoserve.bench.experiment import random_prompt

    rng = random.Random(15)
    arrivals = [(0, f"batch{i}", random_prompt(rng, 384, vocab), n_out, {"tenant": "batch", "priority": 1})
                for i in range(6)]
    for burst, step in enumerate((3, 12, 24)):
        arrivals += [(step, f"chat{burst}-{i}", random_prompt(rng, 16, vocab), n_out,
                      {"tenant": "interactive", "priority": 0}) for i in range(8)]
    return arrivals


def full_step_ms(model) -> float:
    """The median time of one engine step computing a full budget of prompt tokens (3 tries)."""
    from nanoserve.bench.experiment import engine_for, greedy

    engine = engine_for(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                        enable_prefix_caching=False)
    times = []
    for i in range(3):
        engine.add_request(f"cal{i}", list(range(100 + i, 100 + i + BUDGET)), greedy(1))
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1000)
    return sorted(times)[1]


def summarize_run(records: dict, trace: list, tenants: dict, slos: dict) -> dict:
    """Per policy: TTFT / TPOT p50 / p99 (ms) per tenant, goodput, % meeting SLO, rejected %, KV use, tokens/s."""
    from nanoserve.metrics import meets_slos, percentile, request_latencies

    duration = trace[-1]["t"]
    lat = {rid: request_latencies(r) for rid, r in records.items()}
    met = {rid: records[rid].success and meets_slos(lat[rid], slos[tenants[rid]]) for rid in records}
    row = {"goodput": sum(met.values()) / duration, "met_pct": 100 * sum(met.values()) / len(records),
           "rejected_pct": 100 * sum(not r.success for r in records.values()) / len(records),
           "kv_util_pct": 100 * sum(t["blocks_used"] / t["num_blocks"] for t in trace) / len(trace),
           "throughput": sum(r.output_tokens for r in records.values() if r.success) / duration,
           "seconds": duration, "preemptions": trace[-1]["preemptions"]}
    for tenant in ("interactive", "batch"):
        mine = [rid for rid in records if tenants[rid] == tenant and records[rid].success]
        row[f"{tenant}_met_pct"] = 100 * sum(met[rid] for rid in mine) / sum(t == tenant for t in tenants.values())
        for name in ("ttft", "tpot"):
            values = [lat[rid][name] * 1000 for rid in mine if lat[rid][name] is not None]
            for p in (50, 99):
                row[f"{tenant}_{name}_p{p}_ms"] = percentile(values, p) if values else None
    return row


def tiny_model():
    import torch

    from nanoserve.model import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  max_position_embeddings=1024)).eval()


def scheduling(args, model, tokenizer):
    from nanoserve.bench.experiment import drive, engine_for, interleaved

    model = tiny_model()
    n_out = args.output_len or 8
    arrivals = workload(model.config.vocab_size, n_out)
    tenants = {a[1]: a[4]["tenant"] for a in arrivals}
    step_ms = full_step_ms(model)
    slos = {t: {"ttft": ttft * step_ms / 1000, "tpot": tpot * step_ms / 1000} for t, (ttft, tpot) in TARGETS_IN_STEPS.items()}
    tenant_slos = {t: SLOTargets(ttft * step_ms, tpot * step_ms) for t, (ttft, tpot) in TARGETS_IN_STEPS.items()}
    print(f"one full step ({BUDGET} tokens): {step_ms:.0f} ms; interactive SLO: TTFT {slos['interactive']['ttft'] * 1000:.0f} ms, "
          f"TPOT {slos['interactive']['tpot'] * 1000:.0f} ms; batch: TTFT {slos['batch']['ttft'] * 1000:.0f} ms, "
          f"TPOT {slos['batch']['tpot'] * 1000:.0f} ms", file=sys.stderr)

    def measure(name, config, r):
        engine = engine_for(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                            enable_prefix_caching=False, tenant_slos=tenant_slos, **config)
        records, trace = drive(engine, arrivals)
        assert engine.block_manager.get_num_free_blocks() == NUM_BLOCKS  # every block back
        return summarize_run(records, trace, tenants, slos)

    results = interleaved(args.rounds, POLICY_RUNS, measure)
    best = {name: max(runs, key=lambda x: x["goodput"]) for name, runs in results.items()}
    cols = [("interactive_ttft_p50_ms", "chat TTFT p50"), ("interactive_ttft_p99_ms", "p99"),
            ("interactive_tpot_p50_ms", "chat TPOT p50"), ("interactive_tpot_p99_ms", "p99"),
            ("batch_ttft_p99_ms", "batch TTFT p99"), ("goodput", "goodput/s"), ("met_pct", "met SLO %"),
            ("interactive_met_pct", "chat met %"), ("rejected_pct", "rejected %"), ("kv_util_pct", "KV use %"),
            ("throughput", "tok/s")]
    print(f"{'policy':14s}" + "".join(f"{label:>15s}" for _, label in cols))
    for name, row in best.items():
        print(f"{name:14s}" + "".join(f"{'-' if row[k] is None else format(row[k], '.1f'):>15s}" for k, _ in cols))

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(best)
        a.bar(names, [best[n]["interactive_ttft_p99_ms"] or 0 for n in names], color="tab:blue")
        a.axhline(slos["interactive"]["ttft"] * 1000, color="k", ls="--", lw=1, label="interactive TTFT SLO")
        a.set(ylabel="ms", title="interactive tenant: TTFT p99"), a.legend()
        b.bar(names, [best[n]["goodput"] for n in names], color="tab:green")
        b.set(ylabel="requests meeting their SLO per s", title="goodput")
        for ax in (a, b):
            ax.tick_params(axis="x", rotation=20)
        fig.suptitle(f"a bursty two-tenant workload, tiny Llama on this CPU (one full step = {step_ms:.0f} ms)")
        return fig

    return {"step_ms": step_ms, "slos_s": slos, "workload": [(a[0], a[1], len(a[2]), a[3], a[4]) for a in arrivals],
            "results": results, "best": best}, figure


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
    best = {name: min(runs, key=lambda x: x["victim_ttft_p50_ms"]) for name, runs in results.items()}
    cols = [("victim_ttft_p50_ms", "victim TTFT p50"), ("victim_ttft_p99_ms", "p99"),
            ("victim_ttft_p50_steps", "p50 in steps"), ("flood_ttft_p50_ms", "flood TTFT p50"),
            ("seconds", "run s")]
    print(f"{'policy':10s}" + "".join(f"{label:>17s}" for _, label in cols))
    for name, row in best.items():
        print(f"{name:10s}" + "".join(f"{row[k]:>17.1f}" for k, _ in cols))

    def figure(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(best)
        ax.bar(names, [best[n]["victim_ttft_p50_ms"] for n in names], color="tab:blue")
        ax.set(ylabel="ms", title="the victim's TTFT p50 while another tenant floods (tiny Llama)")
        return fig

    return {"workload": {"flood": "128 x (32 prompt, 64 out) at step 0", "victim": "8 x (4 prompt, 2 out), every 10 steps",
                         "max_num_seqs": NOISY_SEATS, "max_num_batched_tokens": NOISY_BUDGET},
            "results": results, "best": best}, figure
