"""`python -m nanoserve bench experiment routing` (chapter 16): Ray Serve's default router against the
prefix-aware one, on a workload where prefixes matter, in one run.

    users          --num-users users, each with a system prompt of its own (~300 tokens, several
                   full KV blocks), asking 3 questions each; requests interleaved user by user
    systems        1 replica (pow2)    the baseline: all prefixes in one KV pool
                   2 replicas, pow2    Ray Serve's power of two choices: a user's turns land anywhere
                   2 replicas, prefix  PrefixAwareRouter: a user's turns follow its system prompt's blocks
    measured       prefix-cache hit rate (the replicas' own counters, nanoserve:prefix_cache_*),
                   TTFT p50 / p99 and output throughput (`bench serve`'s client and summary)

On a 2-core machine two replicas share the same two cores: they cannot beat one on throughput; what
the experiment shows is where each router sends the work and what that does to the hit rate and TTFT.
"""

import json
import os
import tempfile

SYSTEMS = {"1 replica": (1, "pow2"), "2 replicas, pow2": (2, "pow2"), "2 replicas, prefix": (2, "prefix")}
TOPICS = ["astronomy", "cooking", "gardening", "chess", "sailing", "music", "history", "geology", "poetry",
          "cycling", "birds", "trains"]


def workload(num_users: int, turns: int = 3) -> list[dict]:
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


def scrape_prefix_counters() -> tuple[float, float]:
    """(prefix-cache queried tokens, hit tokens), summed over the replicas' /metrics."""
    import httpx

    from nanoserve.cluster.replica import replica_metrics_urls

    queried = hits = 0.0
    for url in replica_metrics_urls().values():
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("nanoserve:prefix_cache_queries_total"):
                queried += float(line.rsplit(" ", 1)[1])
            elif line.startswith("nanoserve:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
    return queried, hits


def routing(args, model, tokenizer) -> dict:
    import importlib

    from nanoserve.bench.serve import measure, serve_args
    from nanoserve.cluster.deploy import serving_fleet, start_ray
    from nanoserve.cluster.replica import ReplicaSpec

    import ray

    num_users, n_out, concurrency = args.num_users, args.output_len or 16, 4
    items = workload(num_users)
    spec = ReplicaSpec(engine_kwargs={"num_blocks": 1024, "max_num_seqs": 8})
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "users.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        start_ray(num_cpus=2)
        try:
            for name, (replicas, router) in SYSTEMS.items():
                with serving_fleet(spec, tokenizer, replicas=replicas, router=router) as (url, fleet):
                    result = measure(serve_args(url, dataset=path, num_prompts=len(items), max_concurrency=concurrency,
                                                output_len=n_out, ignore_eos=True, no_progress=True, warmup=0),
                                     importlib.import_module("nanoserve.metrics"))
                    queried, hits = scrape_prefix_counters()
                    decisions = getattr(fleet.request_router(), "decisions", None)  # the prefix router's counts
                    placed = {}  # user (its system prompt's first block) -> the replicas its turns went to
                    for request_id, replica in fleet.client.routed:
                        placed.setdefault(fleet.client.first_block[request_id], set()).add(replica)
                results[name] = {"hit_rate": hits / queried if queried else 0.0, "hit_tokens": hits,
                                 "queried_tokens": queried, "output_throughput": result["output_throughput"],
                                 "ttft_ms": result["ttft_ms"], "failed": result["failed"],
                                 "replicas_per_user": sum(len(v) for v in placed.values()) / max(len(placed), 1),
                                 "router_decisions": decisions}
                r = results[name]
                print(f"  {name:20s} hit rate {r['hit_rate']:6.1%}  TTFT p50 {r['ttft_ms']['median']:7.0f} ms  "
                      f"p99 {r['ttft_ms']['p99']:7.0f} ms  {r['output_throughput']:6.1f} out tok/s  "
                      f"replicas per user {r['replicas_per_user']:.2f}  failed {r['failed']}"
                      + (f"  router calls {decisions}" if decisions else ""), flush=True)
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()

    def figure(plt):
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        names = list(results)
        axes[0].bar(names, [results[n]["hit_rate"] * 100 for n in names]), axes[0].set_ylabel("prefix-cache hit rate (%)")
        axes[1].bar(names, [results[n]["ttft_ms"]["median"] for n in names], label="p50")
        axes[1].plot(names, [results[n]["ttft_ms"]["p99"] for n in names], "k_", markersize=30, label="p99")
        axes[1].set_ylabel("TTFT (ms)"), axes[1].legend()
        axes[2].bar(names, [results[n]["output_throughput"] for n in names]), axes[2].set_ylabel("output tokens/s")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7)
        fig.suptitle(f"{num_users} users x 3 turns, own ~300-token system prompt each, {concurrency} concurrent")
        return fig

    return {"num_users": num_users, "output_len": n_out, "max_concurrency": concurrency, "results": results}, figure


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
