"""Chapter 15 — the `slo` policy: deadlines instead of arrival order, least laxity first.

A request's targets (SLOTargets: its own, else its tenant's, else the server's) turn into one deadline,
that of its next token, on the scheduler's clock (15.1, `next_token_deadline`):

    no token yet:     arrival_time + ttft                       (the TTFT deadline)
    k tokens so far:  first_token_time + k * tpot               (the TPOT pace: token k is due then)
    no target:        +inf                                      (best effort: after every deadline)

Its **laxity** (15.2) is the deadline less now less the time the work left before that token still takes:
the steps it needs (its uncomputed tokens over the step's token budget, rounded up; 1 for a decode) times
the time of one step, which the policy measures as it goes (`step_s`, a moving average of the scheduler's
clock between two steps while something ran, seeded with the first gap it measures):

    laxity = deadline - now - ceil(remaining tokens / budget) * step_s

    budget 128, step_s 0.02 s, now 1.0; A: decode due at 1.05;  B: 500 prompt tokens left, due at 1.10
    EDF (deadline first):  A (1.05) then B (1.10)
    laxity:  A 1.05 - 1.0 - 1 * 0.02 = 0.03;  B 1.10 - 1.0 - 4 * 0.02 = 0.02     B first, though due later

The order only matters when the budget is contended (tests/test_ch15_policies.py plays this one out):

    budget 3, one step 0.1 s. t=0: B (2-token prompt, due 0.2) and C (5 tokens, due 0.25) arrive;
    t=0.1: A (1 token, due 0.15) arrives. Running sequences get the budget before admissions.
    EDF:  t=0  B 2, C 1     t=0.1  C 3 (running first; A waits)     t=0.2  C 1, A 1: A's token at 0.2, late
    LLF:  t=0  C 3 (laxity 0.05 < B's 0.1)   t=0.1  C 2, A 1 (A -0.05 < B 0)   t=0.2  B 2: all on time

Both queues are served least laxity first (LLF; with step_s = 0, before anything was measured, that is
earliest deadline first). LLF is optimal on one processor that can be preempted at any time; here running
sequences are served before admissions, so a request admitted early keeps the budget it needs, and no order
is optimal in every case: LLF is the better guess when the work left differs. Preemption (15.3) takes the sequence that loses least by it: recompute
preemption drops its computed tokens, so after it its laxity shrinks by the steps of recomputing them;
among those still on time after that (best effort always is), the one with the fewest computed tokens (the
cheapest to recompute; equal costs: the most laxity left); if nobody is, the one the least late. With
`reject=True` (--slo-reject, 15.4) a
waiting request without a first token whose laxity is below zero — it cannot make its TTFT even if it ran
now — is refused with a reason instead of served late: the tokens it would cost go to requests that can
still make theirs (goodput), at the price of a refusal the client sees. Only waiting requests are refused:
a running one (or one preempted after its first token) already has its answer under way.

vLLM has no deadline scheduler; this is the real-time scheduling of Liu & Layland (1973, EDF) and Mok (1983,
least laxity), applied per token as the goodput-oriented LLM schedulers do.
"""

import math

from nanoserve.engine.policies.base import SchedulingPolicy, SLOTargets, arrival_order
from nanoserve.engine.sequence import Sequence

STEP_S_WEIGHT = 0.2  # the moving average's weight of the newest step


def next_token_deadline(seq: Sequence, targets: SLOTargets) -> float:
    """Exercise 15.1's reference: when the sequence's next token is due (scheduler clock seconds); +inf
    without a target."""
    if seq.first_token_time is None:
        return math.inf if targets.ttft_ms is None else seq.arrival_time + targets.ttft_ms / 1000
    if targets.tpot_ms is None:
        return math.inf
    return seq.first_token_time + seq.num_output_tokens * targets.tpot_ms / 1000


def steps_for(num_tokens: int, budget: int) -> int:
    """Steps to compute `num_tokens` at `budget` tokens a step (at least 1: a decode is one step)."""
    return max(1, -(-num_tokens // budget))


class SLOPolicy(SchedulingPolicy):
    name = "slo"

    def __init__(self, budget: int, default: SLOTargets | None = None,
                 tenant_slos: dict[str, SLOTargets] | None = None, reject: bool = False, step_s: float | None = None):
        """budget: the scheduler's max_num_batched_tokens (make_policy passes its config's); step_s: the time of
        one step in seconds, or None to measure it from the clock as the steps go (0 until the first step was
        measured: pure EDF; then that step's time; then a moving average)."""
        self.default = default or SLOTargets()
        self.tenant_slos = tenant_slos or {}
        self.reject = reject
        self.budget = budget
        self.measure = step_s is None
        self.step_s = step_s or 0.0
        self._measured = False  # has a step been measured yet (then the average starts from it, not from 0)
        self._last_now: float | None = None

    def targets(self, seq: Sequence) -> SLOTargets:
        """The request's own targets over its tenant's over the server default."""
        base = self.default
        if seq.tenant in self.tenant_slos:
            base = self.tenant_slos[seq.tenant].over(base)
        return base if seq.slo is None else seq.slo.over(base)

    def deadline(self, seq: Sequence) -> float:
        return next_token_deadline(seq, self.targets(seq))

    def laxity(self, seq: Sequence, now: float) -> float:
        """Exercise 15.2's reference: deadline - now - (steps of the work left before the next token) * step_s;
        +inf without a target."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        return self.deadline(seq) - now - steps_for(remaining, self.budget) * self.step_s

    def least_laxity_first(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        return sorted(seqs, key=lambda s: (self.laxity(s, now), *arrival_order(s)))

    def order_running(self, running: list[Sequence], now: float) -> list[Sequence]:
        """The budget goes first to whoever is closest to missing its next token. Called once a step: the gap
        since the last call is one step's time if something ran all along (else the engine was idle)."""
        if self.measure and self._last_now is not None and running:
            gap = now - self._last_now
            self.step_s = self.step_s + STEP_S_WEIGHT * (gap - self.step_s) if self._measured else gap
            self._measured = True
        self._last_now = now
        return self.least_laxity_first(running, now)

    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        return self.least_laxity_first(waiting, now)

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """Exercise 15.3's reference: the sequence whose preemption costs least. Recompute preemption drops its
        computed tokens: afterwards it needs steps_for(num_tokens) steps before its next token instead of
        steps_for(num_tokens - num_computed_tokens). Among those whose laxity after that is >= 0 (on time even
        so; best effort always), the fewest computed tokens (the cheapest to recompute), then the most laxity
        after it; if none is on time, the largest laxity after it (the least late). Last ties: the latest
        arrival, then the largest seq_id."""

        def after(seq: Sequence) -> float:
            return self.deadline(seq) - now - steps_for(seq.num_tokens, self.budget) * self.step_s

        on_time = [s for s in candidates if after(s) >= 0]
        if on_time:
            return max(on_time, key=lambda s: (-s.num_computed_tokens, after(s), *arrival_order(s)))
        return max(candidates, key=lambda s: (after(s), *arrival_order(s)))

    def reject_reason(self, seq: Sequence, now: float) -> str | None:
        """Exercise 15.4's reference: why a waiting request is refused (None: keep it). With `reject`, a request
        without a first token whose laxity is below 0: its TTFT cannot be met even if it ran from now on."""
        if not self.reject or seq.first_token_time is not None:
            return None
        ttft = self.targets(seq).ttft_ms
        if ttft is None or self.laxity(seq, now) >= 0:
            return None
        steps = steps_for(seq.num_tokens - seq.num_computed_tokens, self.budget)
        return (f"TTFT deadline lost: waited {(now - seq.arrival_time) * 1000:.0f} ms without a first token, the "
                f"target is {ttft:g} ms, and its prompt needs {steps} more step(s) of {self.step_s * 1000:.0f} ms "
                f"(--slo-reject)")

