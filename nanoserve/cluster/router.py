"""Chapter 16 — a prefix-aware request router on Ray Serve's request-router interface.

Ray Serve asks a router one question per request, `choose_replicas(candidates, pending_request)`,
and takes back ranks of replicas, best first; it then sends the request to the rank's replica with
the shortest queue that accepts it (below `max_ongoing_requests`), trying the next rank if none does.

    request      kwargs["block_hashes"] = [h0, h1, h2]   (chapter 05's chain, computed by the ingress
                                                         that tokenized the prompt: no second tokenizer)
    owner_of     {h0: "r1", h1: "r1", ...}               learned from where earlier requests went
    queue lens   {"r1": 5, "r2": 1}                      Ray Serve's own cache of each replica's load
    decision     prefix_affinity(...)  -> [["r1"], ["r2"]]     r1 holds h0 h1, and is not too busy
                 no owner              -> power of two choices over the candidates (the default's idea)

The map is learned, not told: after routing, the request's hashes point at the replica that took it
(it computes and caches those blocks). A router that consumed the replicas' KV events (kv_events.py)
would know evictions too; this one forgets a replica when Ray Serve reports it dead.

Set with `RequestRouterConfig(request_router_class=PrefixAwareRouter, request_router_kwargs={"imbalance": 4})`.
"""

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from nanoserve.student import StudentCode


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_hashes: int = 1 << 16, owner_tries: int = 4,
                         seed: int | None = None, student: bool | str | list[str] = False):
        """imbalance: how many requests busier than the least loaded replica the owner of a prefix may be
        and still get it. max_hashes: how many block hashes the router remembers (LRU). owner_tries: how
        many times Ray Serve may ask the owner alone (its queue-length probe timed out, or it was full)
        before the others are offered too. student: with chapter 16 selected, the learner's
        exercises/16-beyond-one-server/routing.py decides (if finished)."""
        self.imbalance, self.max_hashes, self.owner_tries = imbalance, max_hashes, owner_tries
        self.policies = StudentCode(student).module("nanoserve.cluster.routing")
        self.owner_of: OrderedDict[int, str] = OrderedDict()  # block hash -> replica unique id
        self.tries: OrderedDict[str, int] = OrderedDict()  # request (internal id) -> choose_replicas calls so far
        self.rng = random.Random(seed)
        # what the calls for requests with hashes decided: "owner" (the prefix's replica, alone), "overloaded"
        # (the owner was `imbalance` busier: the least loaded instead), "unanswered" (owner_tries calls spent:
        # the others too), "new" (no replica holds the first block: power of two choices)
        self.decisions = dict.fromkeys(("owner", "overloaded", "unanswered", "new"), 0)

    def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        cache = self.replica_queue_len_cache  # None when stale (no news for 10 s): counted as idle
        return {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in replicas}

    def _remember(self, hashes: list[int], replica: str) -> None:
        for h in hashes:
            self.owner_of[h] = replica
            self.owner_of.move_to_end(h)
        while len(self.owner_of) > self.max_hashes:
            self.owner_of.popitem(last=False)

    def _try_number(self, pending_request: PendingRequest | None) -> int:
        """1 on the first call for this request, 2 on the retry, ... (0 without a request)."""
        if pending_request is None:
            return 0
        key = pending_request.metadata.internal_request_id
        self.tries[key] = self.tries.pop(key, 0) + 1
        while len(self.tries) > 4096:  # requests cancelled before routing never reach on_request_routed
            self.tries.popitem(last=False)
        return self.tries[key]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks for Ray Serve: [[the owner]] while it may still take the request, else [[choice], [the rest,
        shortest queue first]]. Ray Serve walks the ranks and sends to the first replica whose queue length
        (cached, or probed within 0.1 s, doubling per retry) is below max_ongoing_requests; when every rank
        fails it calls again. Offering the others at once would hand a prefix's request to a cold replica
        whenever the owner's probe is merely slow (a loaded machine): the map would then split the prefix."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        queue_lens = self._queue_lens(candidate_replicas)
        hashes = (pending_request.kwargs.get("block_hashes") or []) if pending_request is not None else []
        choice, held = self.policies.prefix_affinity(hashes, self.owner_of, queue_lens, self.imbalance)
        kind = "new" if choice is None else "owner" if held else "overloaded"
        if choice is None:
            choice = self.policies.power_of_two_choices(queue_lens, self.rng)
        if held == 0 and hashes:
            # claim the prefix now, not once the replica accepted: requests for it routed meanwhile follow
            self._remember(hashes, choice)
        if held > 0 and self._try_number(pending_request) > self.owner_tries:
            kind = "unanswered"
        if hashes:
            self.decisions[kind] += 1
        if kind == "owner":
            return [[by_id[choice]]]
        rest = sorted((r for r in candidate_replicas if r.replica_id.unique_id != choice),
                      key=lambda r: queue_lens[r.replica_id.unique_id])
        return [[by_id[choice]]] + ([rest] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The replica accepted: it computes (and caches) the request's blocks, so it owns their hashes."""
        self.tries.pop(pending_request.metadata.internal_request_id, None)
        self._remember(pending_request.kwargs.get("block_hashes") or [], replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        dead = replica_id.unique_id
        for h in [h for h, owner in self.owner_of.items() if owner == dead]:
            del self.owner_of[h]
