"""Chapter 16 — any routing policy (policies.py) on Ray Serve's request-router interface.

Ray Serve asks a router one question per request, `choose_replicas(candidates, pending_request)`,
and takes back ranks of replicas, best first; it then sends the request to the rank's replica with
the shortest queue that accepts it (below `max_ongoing_requests`), trying the next rank if none does.

    request      kwargs["block_hashes"] = [h0, h1, h2]   (chapter 05's chain, computed by the ingress
                                                         that tokenized the prompt: no second tokenizer)
    queue lens   {"r1": 5, "r2": 1}                      Ray Serve's own cache of each replica's load
    policy       choose(hashes, queue lens) -> Choice("r1", "owner", sticky=True)
    ranks        sticky: [["r1"]]  (the owner alone, for owner_tries calls)   else: [["r1"], ["r2"]]

Set with `RequestRouterConfig(request_router_class=PolicyRouter, request_router_kwargs={"policy": "prefix",
"policy_kwargs": {"imbalance": 4}})` (deploy.py does it for `--router`).
"""

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from nanoserve.cluster.policies import make_policy
from nanoserve.student import StudentCode


class PolicyRouter(RequestRouter):
    def initialize_state(self, policy: str = "pow2", policy_kwargs: dict | None = None, owner_tries: int = 4,
                         seed: int | None = None, student: bool | str | list[str] = False):
        """policy: a name in policies.POLICIES; policy_kwargs: its own settings (prefix: imbalance, ...).
        owner_tries: how many times Ray Serve may ask a sticky choice alone (its queue-length probe timed
        out, or it was full) before the others are offered too. student: with chapter 16 selected, the
        learner's exercises/16-beyond-one-server/routing.py decides (its finished rungs)."""
        self.student = StudentCode(student)
        self.policy = make_policy(policy, self.student.module("nanoserve.cluster.routing"), seed=seed,
                                  **(policy_kwargs or {}))
        self.owner_tries = owner_tries
        self.tries: OrderedDict[str, int] = OrderedDict()  # request (internal id) -> choose_replicas calls so far
        # calls by what decided (the policy's Choice.kind), and "unanswered": a sticky choice tried owner_tries
        # times without taking the request, so the others were offered too
        self.decisions: dict[str, int] = {}

    def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        cache = self.replica_queue_len_cache  # None when stale (no news for 10 s): counted as idle
        return {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in replicas}

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
        """Ranks for Ray Serve: [[the choice]] while a sticky choice may still take the request, else
        [[choice], [the rest, shortest queue first]]. Ray Serve walks the ranks and sends to the first
        replica whose queue length (cached, or probed within 0.1 s, doubling per retry) is below
        max_ongoing_requests; when every rank fails it calls again. Offering the others at once would hand
        a prefix's request to a cold replica whenever the owner's probe is merely slow (a loaded machine)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        queue_lens = self._queue_lens(candidate_replicas)
        hashes = (pending_request.kwargs.get("block_hashes") or []) if pending_request is not None else []
        choice = self.policy.choose(hashes, queue_lens)
        kind = choice.kind
        if choice.sticky and self._try_number(pending_request) > self.owner_tries:
            kind = "unanswered"
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
        if kind != "unanswered" and choice.sticky:
            return [[by_id[choice.replica]]]
        rest = sorted((r for r in candidate_replicas if r.replica_id.unique_id != choice.replica),
                      key=lambda r: queue_lens[r.replica_id.unique_id])
        return [[by_id[choice.replica]]] + ([rest] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.tries.pop(pending_request.metadata.internal_request_id, None)
        self.policy.routed(pending_request.kwargs.get("block_hashes") or [], replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
