"""`python -m nanoserve bench experiment kv-routing` (chapter 17): routers over replicas that share nothing
but their KV events, on users with long system prompts, in one run.

    replicas   --replicas LLMEngines on one model's weights, each with its own small KV pool (pressure: a pool
               holds a few users' prefixes, so prefixes are evicted) and a KV-event publisher (chapter 16,
               vLLM's wire format, topic = the replica's name)
    users      --num-users users, 3 turns each, interleaved user by user; --workload says whose prompts:
                 shared-prompts  one application's long system prompt shared by every user, then the user's own
                                 order history, then the conversation so far (shared_prompts below)
                 per-user        each user its own long system prompt (bench/routing.py's workload: 250-token
                                 prompts, 224 tokens shared by a user's turns)
    routers    round-robin          blind
               pow2                 power of two choices on queue lengths (Ray Serve's default)
               prefix (chapter 16)  remembers where it sent each block hash; never hears of an eviction
               kv-aware             the index built from the replicas' events (kv_index.py), longest chain
                                    of leading blocks minus a load cost; events as published (every 50 ms)
               kv-aware, fresh      the same, every replica's events flushed and read before each decision:
                                    what stale events cost is the gap between the two
    measured   prefix-cache hit rate (the replicas' own counters), TTFT p50 / p99, requests per replica

The replicas step in turn in this one thread (a fleet on one 2-core machine could not run them in
parallel either); the `--num-users` requests in flight at once are spread by the router under test.
"""

import importlib
import itertools
import random
import time

from nanoserve.bench.routing import TURNS, workload

ROUTERS = ["round-robin", "pow2", "prefix (chapter 16)", "kv-aware", "kv-aware, fresh"]
LOAD_COST = 2.0  # blocks a queued request is worth (kv_index.choose_replica)
ITEMS = ["inner tubes", "brake pads", "chains", "saddles", "lamps", "pumps", "bells", "mudguards", "tyres", "locks"]


def shared_prompts(num_users: int, turns: int = TURNS) -> list[dict]:
    """Chat requests to one application, a bicycle shop's assistant: its long system prompt is every user's;
    user u's first turn brings u's own order history, and each later turn resends the conversation (the
    answers are fixed text: a replay does not wait for what the model says) with one more question. Turns come
    one per round, user after user. In SmolLM2's tokens, 16 to a block:

        turn 1   [ the shop's prompt: 13 full blocks, every user's | u's orders, question 1 ]   365-371 tokens
        turn 2   [ u's turn 1, all of it | answer 1, question 2 ]                               397-403 tokens
        turn 3   [ u's turn 2, all of it | answer 2, question 3 ]                               429-435 tokens
    """
    system = ("You are the assistant of a bicycle shop. " +
              "Answer every customer of the shop politely, in two short sentences, without lists. " * 12)
    items = []
    for t in range(turns):
        for u in range(num_users):
            rng = random.Random(u)  # u's orders, the same at every turn
            orders = "; ".join(f"order {u}-{k}: {rng.randint(1, 9)} {rng.choice(ITEMS)}" for k in range(12))
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"I am customer {u}. My orders so far: {orders}. Question 1: "
                                                    f"which of these wear out first?"}]
            for k in range(1, t + 1):
                messages += [{"role": "assistant", "content": f"Thank you, customer {u}: tyres and brake pads."},
                             {"role": "user", "content": f"Question {k + 1}: and after those?"}]
            items.append({"messages": messages})
    return items


WORKLOADS = {"shared-prompts": shared_prompts, "per-user": workload}  # --workload (the first is the default)


class Fleet:
    """The replicas, their publishers, and the subscriber's index."""

    def __init__(self, model, tokenizer, num_replicas: int, num_blocks: int, student=None):
        """student: the run's StudentCode (--student 17: the learner's index and score, exercises 17.2, 17.3)."""
        from nanoserve.engine.config import engine_config
        from nanoserve.engine.llm_engine import LLMEngine
        from nanoserve.kv.kv_events import record_kv_events
        from nanoserve.server.kv_events import KVEventPublisher

        self.names = [f"r{i}" for i in range(num_replicas)]
        self.engines = {n: LLMEngine(model, engine_config(num_blocks=num_blocks, max_num_seqs=4), tokenizer)
                        for n in self.names}
        self.publishers = {n: KVEventPublisher(record_kv_events(e.block_manager), "tcp://127.0.0.1:*", topic=n)
                           for n, e in self.engines.items()}
        self.kv_index = (student.module if student is not None else importlib.import_module)("nanoserve.disagg.kv_index")
        self.index = self.kv_index.KVIndex()
        self.subscriber = self.kv_index.KVEventSubscriber(self.index, {n: p.endpoint for n, p in self.publishers.items()})
        time.sleep(0.3)  # ZMQ's slow joiner: a SUB socket misses what is published before it has connected

    def queue_lens(self) -> dict[str, int]:
        return {n: e.get_num_unfinished_requests() for n, e in self.engines.items()}

    def fresh(self) -> None:
        """Every event recorded so far published and applied: the index as the replicas are now. A publisher
        numbers its batches 0, 1, ...: the subscriber is caught up when it saw each one's last number, and the
        publisher thread has taken every event from its log (checked twice, a publishing period apart, so that
        a batch taken but not yet sent is waited for)."""
        def caught_up() -> bool:
            self.subscriber.poll(0)
            # (a replica never heard from counts as caught up: its first batch, AllBlocksCleared, may have gone
            # out before the subscription was up — ZMQ's slow joiner — and says nothing the empty index lacks)
            return all(not p.log.events and self.subscriber.last_seq.get(n, p.seq - 1) >= p.seq - 1
                       for n, p in self.publishers.items())

        while not (caught_up() and time.sleep(0.06) is None and caught_up()):
            self.subscriber.poll(50)

    def close(self) -> None:
        self.subscriber.close()
        for p in self.publishers.values():
            p.close()


def make_router(name: str, fleet: Fleet, block_size: int):
    """route(prompt ids) -> replica name, for router `name`."""
    from nanoserve.cluster.routing import power_of_two_choices, prefix_affinity, round_robin
    from nanoserve.kv.prefix_cache import block_hashes

    rng, turns, owner_of = random.Random(0), itertools.count(), {}

    def route(prompt: list[int]) -> str:
        hashes, queues = block_hashes(prompt, block_size), fleet.queue_lens()
        if name == "round-robin":
            return round_robin(queues, next(turns))
        if name == "pow2":
            return power_of_two_choices(queues, rng)
        if name == "prefix (chapter 16)":
            choice, _ = prefix_affinity(hashes, owner_of, queues, imbalance=4)
            choice = choice or power_of_two_choices(queues, rng)
            owner_of.update(dict.fromkeys(hashes, choice))  # it will compute them: it owns them now (it thinks)
            return choice
        if name == "kv-aware, fresh":
            fleet.fresh()
        else:
            fleet.subscriber.poll()
        return fleet.kv_index.choose_replica(fleet.index.longest_prefix(hashes, fleet.names), queues, LOAD_COST)

    return route


def run_one(name: str, model, tokenizer, prompts: list[list[int]], args, student=None) -> dict:
    """One router over a fresh fleet: the prompts, `args.num_users` in flight at once, to the end."""
    from nanoserve.bench.experiment import greedy
    from nanoserve.metrics import percentile

    fleet = Fleet(model, tokenizer, args.replicas, args.num_blocks, student)
    route = make_router(name, fleet, fleet.engines["r0"].config.cache_config.block_size)
    pending, started, ttft, placed = list(enumerate(prompts)), {}, [], {n: 0 for n in fleet.names}
    try:
        while pending or any(e.has_unfinished_requests() for e in fleet.engines.values()):
            while pending and sum(fleet.queue_lens().values()) < args.num_users:  # closed loop
                i, prompt = pending.pop(0)
                replica = route(prompt)
                placed[replica] += 1
                fleet.engines[replica].add_request(str(i), prompt, greedy(args.output_len or 4))
                started[str(i)] = time.perf_counter()
            for engine in fleet.engines.values():
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if len(out.token_ids) == 1 and out.new_token_ids:
                            ttft.append((time.perf_counter() - started[out.request_id]) * 1000)
    finally:
        fleet.close()
    stats = [e.block_manager.stats for e in fleet.engines.values()]
    queried, hits = sum(s.queried_tokens for s in stats), sum(s.hit_tokens for s in stats)
    return {"hit_rate": hits / queried, "hit_tokens": hits, "queried_tokens": queried,
            "evicted_blocks": sum(s.evicted_blocks for s in stats), "requests_per_replica": placed,
            "ttft_ms": {"median": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "events_applied": fleet.index.num_events, "sequence_gaps": fleet.subscriber.num_gaps}


def kv_routing(args, model, tokenizer) -> tuple[dict, object]:
    from nanoserve.bench.experiment import interleaved

    from nanoserve.student import StudentCode

    student = StudentCode(args.student or False)
    which = args.workload or next(iter(WORKLOADS))
    prompts = [tokenizer.encode_chat(item["messages"]) for item in WORKLOADS[which](args.num_users)]
    rounds = interleaved(args.rounds, dict.fromkeys(ROUTERS),
                         lambda name, _, r: run_one(name, model, tokenizer, prompts, args, student))
    if student:
        print(student.describe("the KV-aware router runs"), "\n" + student.proof(), flush=True)
    results = {name: max(runs, key=lambda x: x["hit_rate"]) for name, runs in rounds.items()}
    for name, r in results.items():
        print(f"  {name:20s} hit rate {r['hit_rate']:6.1%}  TTFT p50 {r['ttft_ms']['median']:7.0f} ms  "
              f"p99 {r['ttft_ms']['p99']:7.0f} ms  evicted {r['evicted_blocks']:4d}  "
              f"per replica {r['requests_per_replica']}", flush=True)

    def figure(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        names = list(results)
        axes[0].bar(names, [results[n]["hit_rate"] * 100 for n in names]), axes[0].set_ylabel("prefix-cache hit rate (%)")
        axes[1].bar(names, [results[n]["ttft_ms"]["median"] for n in names], label="p50")
        axes[1].plot(names, [results[n]["ttft_ms"]["p99"] for n in names], "k_", markersize=30, label="p99")
        axes[1].set_ylabel("TTFT (ms)"), axes[1].legend()
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7, rotation=20)
        fig.suptitle(f"{which}: {args.replicas} replicas x {args.num_blocks} blocks, "
                     f"{args.num_users} users x {TURNS} turns")
        return fig

    return {"workload": which, "replicas": args.replicas, "num_blocks": args.num_blocks, "num_users": args.num_users,
            "load_cost": LOAD_COST, "results": results}, figure
