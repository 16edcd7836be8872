"""`python -m nanoserve bench experiment routing` (chapter 16): the routers on a workload where prefixes
matter, and one replica against two on the same cores, in one run.

    users          --num-users users (chapter 16 runs 9: with an even count round robin's a, b, a, b would pin
                   each user to one replica by coincidence), each with a system prompt of its own (the whole prompt, chat
                   template included, is 250 tokens, of which a user's turns share 14 full blocks: 224 tokens),
                   asking 3 questions each; requests interleaved user by user, 4 in flight
    systems        1 replica x 2 cores       the baseline: all prefixes in one KV pool, both cores in one engine
                   2 x 1 core, round-robin   the same two cores in two engines; turns alternate blindly
                   2 x 1 core, pow2          power of two choices: a user's turns land anywhere
                   2 x 1 core, prefix        prefix affinity: a user's turns follow its system prompt's blocks
    rounds         --rounds rounds; each deploys every system afresh (empty prefix caches), warms it up with
                   4 short requests that share nothing with the users', then measures; the order alternates
                   (A B C D, D C B A, ...)
    measured       TTFT mean and p99 (`bench serve`'s client), error rate, the prefix-cache hit rate (the
                   replicas' own counters, nanoserve:prefix_cache_*, over the measured requests), and each
                   replica's share of the requests and of the tokens it computed (prefill not served from its
                   cache, plus decode): how evenly the router spread the work

Both kinds of fleet hold two cores: what the experiment shows is where each router sends the work and what
that does to the hit rate and TTFT, not the speed-up of more hardware (chapter 16, section 6).
"""

import json
import os
import tempfile

from nanoserve.bench.experiment import interleaved

# name -> (replicas, router, cores per replica): every system holds 2 cores
SYSTEMS = {"1 replica x 2 cores": (1, "pow2", 2), "2 x 1 core, round-robin": (2, "round-robin", 1),
           "2 x 1 core, pow2": (2, "pow2", 1), "2 x 1 core, prefix": (2, "prefix", 1)}
TOPICS = ["astronomy", "cooking", "gardening", "chess", "sailing", "music", "history", "geology", "poetry",
          "cycling", "birds", "trains"]
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "generation_tokens_total")
TURNS, CONCURRENCY, OUTPUT_LEN = 3, 4, 16  # questions per user, requests in flight, output tokens (--output-len)
WARMUP_REQUESTS = 4  # short requests per system before the measured ones, sharing nothing with the users'
MAX_NUM_SEQS = 8  # each engine's batch: above CONCURRENCY, so that one replica can batch every request in flight


def workload(num_users: int, turns: int = TURNS) -> list[dict]:
    """Chat requests: user u's system prompt is long and its own; its turns come one per round."""
    items = []
    for t in range(turns):
        for u in range(num_users):
            topic = TOPICS[u % len(TOPICS)]
            system = (f"You are a patient expert on {topic} (user {u}). " +
                      f"Answer every question about {topic} in two short sentences, plainly, without lists. " * 14)
            items.append({"messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": f"Question {t + 1}: what should a beginner in "
                                                                   f"{topic} learn first?"}]})
    return items


def shared_prefix(tokenizer, items: list[dict], num_users: int, block_size: int) -> tuple[int, int]:
    """(prompt tokens of user 0's first turn, the full blocks' tokens its turns share): the hit rate's ceiling
    is (turns - 1) x shared / (turns x prompt)."""
    first, second = (tokenizer.encode_chat(items[i]["messages"]) for i in (0, num_users))
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(first))
    return len(first), common // block_size * block_size


def scrape_counters() -> dict[str, dict[str, float]]:
    """replica id -> {counter: value} for COUNTERS, from each replica's own /metrics."""
    import httpx

    from nanoserve.cluster.replica import replica_metrics_urls

    out = {}
    for replica, url in replica_metrics_urls().items():
        values = dict.fromkeys(COUNTERS, 0.0)
        for line in httpx.get(url, timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("nanoserve:")
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        out[replica] = values
    return out


def routing(args, model, tokenizer) -> dict:
    import importlib

    from nanoserve.bench.serve import measure, serve_args
    from nanoserve.cluster.deploy import serving_fleet, start_ray
    from nanoserve.cluster.replica import ReplicaSpec

    import ray

    num_users, n_out, concurrency, turns = args.num_users, args.output_len or OUTPUT_LEN, CONCURRENCY, TURNS
    items = workload(num_users, turns)
    spec = ReplicaSpec(engine_kwargs={"num_blocks": 1024, "max_num_seqs": MAX_NUM_SEQS})
    prompt_len, shared = shared_prefix(tokenizer, items, num_users, block_size=16)
    ceiling = (turns - 1) * shared / (turns * prompt_len)
    metrics = importlib.import_module("nanoserve.metrics")

    def run_system(name, system, r):
        replicas, router, cores = system
        with serving_fleet(spec, tokenizer, replicas=replicas, router=router, replica_cpus=cores) as (url, fleet):
            measure(serve_args(url, dataset=warm, num_prompts=WARMUP_REQUESTS, max_concurrency=4, output_len=4,
                               ignore_eos=True, no_progress=True, warmup=0), metrics)
            before, routed_before = scrape_counters(), len(fleet.client.routed)
            result = measure(serve_args(url, dataset=users, num_prompts=len(items), max_concurrency=concurrency,
                                        output_len=n_out, ignore_eos=True, no_progress=True, warmup=0), metrics)
            after = scrape_counters()
            routed = list(fleet.client.routed)[routed_before:]
            decisions = dict(getattr(fleet.request_router(), "decisions", {}))
        delta = {rid: {c: after[rid][c] - before.get(rid, {}).get(c, 0.0) for c in COUNTERS} for rid in after}
        queried = sum(d["prefix_cache_queries_total"] for d in delta.values())
        hits = sum(d["prefix_cache_hits_total"] for d in delta.values())
        work = {rid: d["prefix_cache_queries_total"] - d["prefix_cache_hits_total"] + d["generation_tokens_total"]
                for rid, d in delta.items()}
        requests = {rid: sum(1 for _, where in routed if where == rid) for rid in delta}
        placed = {}  # user (its system prompt's first block) -> the replicas its turns went to
        for request_id, replica in routed:
            placed.setdefault(fleet.client.first_block.get(request_id), set()).add(replica)
        x = {"ttft_ms": result["ttft_ms"], "error_rate": result["failed"] / len(items),
             "hit_rate": hits / queried if queried else 0.0,
             "request_share": sorted((n / max(len(routed), 1) for n in requests.values()), reverse=True),
             "work_share": sorted((w / max(sum(work.values()), 1) for w in work.values()), reverse=True),
             "replicas_per_user": sum(len(v) for v in placed.values()) / max(len(placed), 1),
             "output_throughput": result["output_throughput"], "router_decisions": decisions}
        print(f"  round {r + 1} {name:24s} TTFT mean {x['ttft_ms']['mean']:6.0f} ms  p99 {x['ttft_ms']['p99']:6.0f} ms"
              f"  errors {x['error_rate']:4.0%}  hit rate {x['hit_rate']:6.1%}  requests "
              f"{'/'.join(f'{s:.0%}' for s in x['request_share'])}  work "
              f"{'/'.join(f'{s:.0%}' for s in x['work_share'])}  replicas per user {x['replicas_per_user']:.2f}"
              f"  {decisions}", flush=True)
        return x

    with tempfile.TemporaryDirectory() as tmp:
        users, warm = os.path.join(tmp, "users.jsonl"), os.path.join(tmp, "warm.jsonl")
        with open(users, "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        with open(warm, "w") as f:
            f.writelines(json.dumps({"prompt": f"Warm-up {i}: count to ten."}) + "\n" for i in range(WARMUP_REQUESTS))
        start_ray(num_cpus=2, tries=6)  # a loaded machine: the raylet may miss Ray's 30 s start-up limit
        try:
            runs = interleaved(args.rounds, SYSTEMS, run_system)
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()

    def mean(values):
        return sum(values) / len(values)

    summary = {name: {"ttft_mean_ms": mean([x["ttft_ms"]["mean"] for x in xs]),
                      "ttft_p99_ms": mean([x["ttft_ms"]["p99"] for x in xs]),
                      "ttft_mean_ms_rounds": [round(x["ttft_ms"]["mean"]) for x in xs],
                      "ttft_p99_ms_rounds": [round(x["ttft_ms"]["p99"]) for x in xs],
                      "error_rate": mean([x["error_rate"] for x in xs]), "hit_rate": mean([x["hit_rate"] for x in xs]),
                      "busiest_work_share": mean([x["work_share"][0] for x in xs]),
                      "replicas_per_user": mean([x["replicas_per_user"] for x in xs])}
               for name, xs in runs.items()}
    print(f"\nmeans over {args.rounds} rounds (prompt {prompt_len} tokens, {shared} shared per user: hit-rate "
          f"ceiling {ceiling:.1%})")
    print(f"{'system':26s}{'TTFT mean':>10s}{'p99':>8s}   per round (mean | p99){'':9s}{'errors':>7s}{'hit rate':>9s}"
          f"{'busiest':>9s}{'replicas/user':>14s}")
    for name, s in summary.items():
        rounds = f"{s['ttft_mean_ms_rounds']} | {s['ttft_p99_ms_rounds']}"
        print(f"{name:26s}{s['ttft_mean_ms']:8.0f}ms{s['ttft_p99_ms']:6.0f}ms   {rounds:32s}{s['error_rate']:6.0%}"
              f"{s['hit_rate']:9.1%}{s['busiest_work_share']:9.0%}{s['replicas_per_user']:14.2f}")

    def figure(plt):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        names = list(summary)
        axes[0].bar(names, [summary[n]["hit_rate"] * 100 for n in names])
        axes[0].axhline(ceiling * 100, color="k", ls=":", label="ceiling"), axes[0].legend()
        axes[0].set_ylabel("prefix-cache hit rate (%)")
        for i, n in enumerate(names):
            axes[1].plot([i] * args.rounds, summary[n]["ttft_mean_ms_rounds"], "o", color="C0")
            axes[1].plot([i] * args.rounds, summary[n]["ttft_p99_ms_rounds"], "_", color="k", markersize=20)
        axes[1].set_xticks(range(len(names)), names), axes[1].set_ylabel("TTFT per round: mean (o), p99 (-) ms")
        axes[2].bar(names, [summary[n]["busiest_work_share"] * 100 for n in names])
        axes[2].axhline(50, color="k", ls=":"), axes[2].set_ylabel("busiest replica's share of the work (%)")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7, rotation=20)
        fig.suptitle(f"{num_users} users x {turns} turns, {prompt_len}-token prompts ({shared} shared per user), "
                     f"{concurrency} in flight, {args.rounds} interleaved rounds; every system holds 2 cores")
        return fig

    return {"num_users": num_users, "turns": turns, "output_len": n_out, "max_concurrency": concurrency,
            "prompt_tokens": prompt_len, "shared_prefix_tokens": shared, "hit_rate_ceiling": ceiling,
            "rounds": args.rounds, "summary": summary, "runs": runs}, figure


def autoscaling_trace(url: str, fleet, autoscaling, model: str, clients: int = 4, max_tokens: int = 40,
                      interval_s: float = 0.5, up_timeout_s: float = 120, down_timeout_s: float = 60) -> dict:
    """A closed-loop burst against an autoscaling fleet, then idle; the trace of both (chapter 16).

    `clients` clients each send their next completion as soon as the last one ended, so `clients` requests
    stay in flight until Ray Serve runs max_replicas replicas (the burst lasts as long as the autoscaler
    needs, never less); then they stop, and the trace goes on until it is back to min_replicas.
    autoscaling: the fleet's deploy.Autoscaling; model: the served model's name.

        {"trace": [(seconds, replicas running, replicas starting, requests in flight at the ingress), ...],
         "statuses": [200, ...], "scaled_up": True, "scaled_down": True}
    """
    import asyncio
    import threading
    import time

    import httpx

    from nanoserve.cluster.deploy import wait_for

    stop, statuses, trace, t0 = threading.Event(), [], [], time.monotonic()

    async def burst():
        async def one_client(http):
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                    "temperature": 0}
            while not stop.is_set():
                statuses.append((await http.post("/v1/completions", json=body)).status_code)

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.gather(*(one_client(http) for _ in range(clients)))

    def sample(want: int) -> bool:
        states = fleet.replica_states()
        trace.append((round(time.monotonic() - t0, 2), states.get("RUNNING", 0), states.get("STARTING", 0),
                      fleet.client.in_flight))
        return trace[-1][1] == want

    worker = threading.Thread(target=lambda: asyncio.run(burst()), name="nanoserve-burst")
    worker.start()
    try:
        scaled_up = wait_for(lambda: sample(autoscaling.max_replicas), up_timeout_s, interval_s)
    finally:
        stop.set()
        worker.join()
    scaled_down = wait_for(lambda: sample(autoscaling.min_replicas), down_timeout_s, interval_s)
    return {"trace": trace, "statuses": statuses, "scaled_up": scaled_up, "scaled_down": scaled_down}
