"""Chapter 15 — the `fair` policy: weighted fair sharing of the step's tokens across tenants.

Each tenant has a virtual time: the tokens it was served divided by its weight. The tenant with the lowest
virtual time goes next; serving n of its tokens moves it on by n / weight. Two tenants of weight 1 that are
both backlogged therefore get the same number of tokens, whatever each one sends; with weights 3:1, 3:1.
This is weighted fair queueing (Demers, Keshav, Shenker 1989), with tokens for bytes; the vLLM-adjacent
"fairness in serving LLMs" work (Sheng et al., OSDI 2024, the Virtual Token Counter) does the same.

    tenants a (weight 1) and b (weight 1), virtual times a=0, b=0; a's decodes a1 a2 a3, b's decode b1
    order:  a1 (a:0 -> 1)  b1 (b:0 -> 1)  a2 (a:1 -> 2)  a3      a budget of 2 serves a1 and b1

A tenant that comes back after being idle starts at the lowest virtual time of the tenants that were busy
(not at its old, low one): idle time is not credit to flood with later. Within a tenant, arrival order.
When the pool is short, the victim comes from the tenant with the highest virtual time (the one served most
for its weight), its latest arrival.
"""

import heapq

from nanoserve.engine.policies.base import SchedulingPolicy, arrival_order
from nanoserve.engine.sequence import Sequence


def remaining_tokens(seq: Sequence) -> int:
    """What the sequence would compute next if the budget allowed: its uncomputed tokens (1 for a decode)."""
    return max(1, seq.num_tokens - seq.num_computed_tokens)


def fair_order(seqs: list[Sequence], virtual_time: dict, weights: dict, cost=remaining_tokens) -> list[Sequence]:
    """Exercise 15.5's reference: `seqs` in weighted-fair order, the order in which the step's budget is spent.

    Each tenant's sequences keep their arrival order; the next one comes from the tenant whose projected
    virtual time is the lowest (ties by tenant name), which then moves on by cost(seq) / weight.
    `virtual_time`: tenant -> its virtual time now (missing: 0); `weights`: tenant -> weight (missing: 1).
    Nothing is charged here: `virtual_time` is not modified.
    """
    queues: dict = {}
    for seq in sorted(seqs, key=arrival_order):
        queues.setdefault(seq.tenant, []).append(seq)
    heap = [(virtual_time.get(t, 0.0), str(t), t) for t in queues]
    heapq.heapify(heap)
    order = []
    while heap:
        vt, name, tenant = heapq.heappop(heap)
        seq = queues[tenant].pop(0)
        order.append(seq)
        if queues[tenant]:
            heapq.heappush(heap, (vt + cost(seq) / weights.get(tenant, 1.0), name, tenant))
    return order


class FairPolicy(SchedulingPolicy):
    name = "fair"

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        for tenant, w in self.weights.items():
            if not w > 0:
                raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {w}")
        self.virtual_time: dict = {}  # tenant -> tokens served / weight
        self._busy: set = set()  # tenants with a live request at the last step
        self._running_tenants: set = set()

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        return fair_order(seqs, self.virtual_time, self.weights)

    def order_running(self, running: list[Sequence], now: float) -> list[Sequence]:
        self._running_tenants = {s.tenant for s in running}
        return self.order(running)

    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        # called once per step, after order_running: the busy tenants are those running or waiting now
        self.catch_up(self._running_tenants | {s.tenant for s in waiting})
        return self.order(waiting)

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """The latest arrival of the candidate tenant with the highest virtual time (ties: the larger tenant
        name): the tenant that was served most for its weight gives the blocks back.

            virtual times a 5, b 2; candidates a1, b1, a2 (arrival order)  ->  a2
        """
        tenant = max({s.tenant for s in candidates}, key=lambda t: (self.virtual_time.get(t, 0.0), str(t)))
        return max((s for s in candidates if s.tenant == tenant), key=arrival_order)

    def catch_up(self, busy: set) -> None:
        """Exercise 15.6's reference: `busy` are the tenants with work now. One that was not busy at the last
        call (back from idle, or new) starts at the lowest virtual time of the tenants busy then and now —
        never below its own: idle time is not credit. Remembers `busy` for the next call."""
        floor = min((self.virtual_time.get(t, 0.0) for t in busy & self._busy), default=None)
        if floor is not None:
            for tenant in busy - self._busy:
                self.virtual_time[tenant] = max(self.virtual_time.get(tenant, 0.0), floor)
        self._busy = set(busy)

    def on_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """Exercise 15.6's reference: `num_tokens` of `seq` go into this step: its tenant's virtual time moves
        on by num_tokens / weight (weight 1 when not given)."""
        self.virtual_time[seq.tenant] = self.virtual_time.get(seq.tenant, 0.0) + num_tokens / self.weights.get(seq.tenant, 1.0)
