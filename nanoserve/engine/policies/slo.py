"""Chapter 15 — the `slo` policy: deadlines instead of arrival order (earliest-deadline-first).

A request's targets (SLOTargets: its own, else its tenant's, else the server's) turn into one deadline,
that of its next token, on the scheduler's clock:

    no token yet:     arrival_time + ttft                       (the TTFT deadline)
    k tokens so far:  first_token_time + k * tpot               (the TPOT pace: token k is due then)
    no target:        +inf                                      (best effort: after every deadline)

    ttft 0.5 s, tpot 0.1 s; A arrived at t=0, B at t=0.2 with ttft 0.1 s (a tighter target)
    deadlines:  A 0.5, B 0.3       -> B is admitted first although it came later
    A's first token at t=0.4, 3 tokens at t=0.55: due at 0.4 + 3*0.1 = 0.7, slack at t=0.55: 0.15 s

Admission takes the earliest deadline first (15.1), the step's budget goes first to the running sequence
with the least slack (deadline - now: the one about to miss its TPOT), and preemption takes the one with
the most slack (15.2): it can best afford to recompute. With `reject=True` (--slo-reject) a request that
has not got its first token when its TTFT deadline passes is refused with a reason, not served late: the
tokens it would have cost go to requests that can still make it (goodput), at the price of a refusal the
client sees. vLLM has no deadline scheduler; this is the textbook EDF of real-time systems (Liu & Layland
1973) applied per token, as the goodput-oriented LLM schedulers do.
"""

import math

from nanoserve.engine.policies.base import SchedulingPolicy, SLOTargets
from nanoserve.engine.sequence import Sequence


def next_token_deadline(seq: Sequence, targets: SLOTargets) -> float:
    """When the sequence's next token is due (scheduler clock seconds); +inf without a target."""
    if seq.first_token_time is None:
        return math.inf if targets.ttft_ms is None else seq.arrival_time + targets.ttft_ms / 1000
    if targets.tpot_ms is None:
        return math.inf
    return seq.first_token_time + seq.num_output_tokens * targets.tpot_ms / 1000


class SLOPolicy(SchedulingPolicy):
    name = "slo"

    def __init__(self, default: SLOTargets | None = None, tenant_slos: dict[str, SLOTargets] | None = None,
                 reject: bool = False):
        self.default = default or SLOTargets()
        self.tenant_slos = tenant_slos or {}
        self.reject = reject

    def targets(self, seq: Sequence) -> SLOTargets:
        """The request's own targets over its tenant's over the server default."""
        base = self.default
        if seq.tenant in self.tenant_slos:
            base = self.tenant_slos[seq.tenant].over(base)
        return base if seq.slo is None else seq.slo.over(base)

    def deadline(self, seq: Sequence) -> float:
        return next_token_deadline(seq, self.targets(seq))

    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        """Exercise 15.1's reference: earliest deadline first; equal deadlines (or none) in arrival order."""
        return sorted(waiting, key=lambda s: (self.deadline(s), s.arrival_time, s.seq_id))

    def order_running(self, running: list[Sequence], now: float) -> list[Sequence]:
        """The least slack first: the budget goes first to whoever is about to miss its next token."""
        return sorted(running, key=lambda s: (self.deadline(s), s.arrival_time, s.seq_id))

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """Exercise 15.2's reference: the most slack (deadline - now); a tie goes to the latest arrival."""
        return max(candidates, key=lambda s: (self.deadline(s) - now, s.arrival_time, s.seq_id))

    def reject_reason(self, seq: Sequence, now: float) -> str | None:
        if not self.reject or seq.first_token_time is not None:
            return None
        ttft = self.targets(seq).ttft_ms
        if ttft is None or now <= seq.arrival_time + ttft / 1000:
            return None
        return (f"TTFT deadline lost: waited {(now - seq.arrival_time) * 1000:.0f} ms without a first token, "
                f"the target is {ttft:g} ms (--slo-reject)")
