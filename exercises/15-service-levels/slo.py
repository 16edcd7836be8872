"""Exercises 15.1 to 15.4 — the `slo` scheduling policy: deadlines, laxity, the preemption victim, admission control.

This file mirrors nanoserve/engine/policies/slo.py. Your class inherits the reference SLOPolicy, so what you
do not write is given: `targets(seq)` (the request's SLOTargets over its tenant's over the server's), the
orders (`order_running` / `order_waiting` sort by your `laxity`, then arrival), and the measured step time
`self.step_s` (seconds; 0 until one step was measured) with the step's token budget `self.budget`. The
scheduler (chapter 06) calls the policy once per step with `now`, its clock's time in seconds.

    15.1  next_token_deadline   when a sequence's next token is due
    15.2  SLOPolicy.laxity      how long it can still wait: least laxity is served first
    15.3  SLOPolicy.choose_victim   whom to preempt, counting what recomputing it costs
    15.4  SLOPolicy.reject_reason   whom to refuse rather than serve late (--slo-reject)

Each rung is graded alone (`make grade CH=15 EX=15.3`). README.md has the questions to answer first.
"""

from nanoserve.engine.policies.base import SLOTargets
from nanoserve.engine.policies.base import arrival_order  # noqa: F401  (arrival_order(seq): (arrival_time, seq_id))
from nanoserve.engine.policies.slo import SLOPolicy as ReferenceSLOPolicy
from nanoserve.engine.policies.slo import steps_for  # noqa: F401  (steps_for(n, budget): ceil(n / budget), >= 1)
from nanoserve.engine.sequence import Sequence


def next_token_deadline(seq: Sequence, targets: SLOTargets) -> float:
    """Exercise 15.1: when `seq`'s next token is due, in seconds on the scheduler's clock.

    Inputs: `seq.arrival_time`, `seq.first_token_time` (None before the first token), `seq.num_output_tokens`
    (k); `targets.ttft_ms` / `targets.tpot_ms` in milliseconds, either may be None (no target).
    Before the first token the TTFT target applies, from arrival; after it, token k is due k TPOTs after the
    first token (a pace, so a token that came early is credit for the next). No applicable target: +inf.

        arrival 2.0, TTFT 500 ms, no token yet                       -> 2.5
        first token at 2.4, 3 tokens so far, TPOT 100 ms              -> 2.7
        first token at 2.4, no TPOT target                            -> inf
    """
    raise NotImplementedError("Exercise 15.1: write next_token_deadline (see its docstring and README.md)")


class SLOPolicy(ReferenceSLOPolicy):
    def deadline(self, seq: Sequence) -> float:
        return next_token_deadline(seq, self.targets(seq))  # yours (given: the reference's calls its own)

    def laxity(self, seq: Sequence, now: float) -> float:
        """Exercise 15.2: how many seconds `seq` can still wait, at `now`, and make its next deadline
        (`self.deadline(seq)`), given the work it has left before that token.

        Contract: the work left is counted in whole steps of the scheduler (a step computes at most
        `self.budget` tokens and takes `self.step_s` seconds; a decode is one step). Returns deadline - now
        when no work were left, less the time of those steps. Negative: it cannot make it any more.
        +inf without a target. Depends on `now`, `seq`'s tokens computed so far, and nothing else.

            budget 128, step_s 0.02, now 1.0
            a decode due 1.05                                   -> 0.03
            510-token prompt, 10 computed, due 1.10             -> 0.02   (needs 4 steps)
            the same with 300 computed                          -> 0.06   (2 steps)
            step_s 0 (nothing measured yet)                     -> deadline - now: the order is EDF's
        """
        raise NotImplementedError("Exercise 15.2: write SLOPolicy.laxity (see its docstring and README.md)")

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """Exercise 15.3: which of `candidates` (non-empty; running sequences not scheduled yet this step) to
        preempt when the pool is short. Return one of them; the scheduler frees its blocks.

        Contract: preemption is by recompute, so a victim loses every token it had computed and must compute
        them all again before its next token. Take the candidate whose preemption costs least:
        1. one still on time for its next deadline after that loss (best effort always is) over one that
           would be late;
        2. among the on-time ones, the one that loses the least computed work; then the one with the most
           laxity left after the loss;
        3. if all would be late, the one the least late after the loss;
        4. last ties: the latest arrival, then the largest seq_id.

            budget 4, step_s 0.1, now 1.0
            X: 12 tokens, 11 computed, due 1.9;  Y: 8 tokens, 7 computed, due 1.9     -> Y (both on time; Y loses less)
            X as above;  Z: 8 tokens, 7 computed, due 1.05 (late once it recomputes)   -> X
            Z;  W: 12 tokens, 11 computed, due 1.05 (both late; W later still)          -> Z
        """
        raise NotImplementedError("Exercise 15.3: write SLOPolicy.choose_victim (see its docstring and README.md)")

    def reject_reason(self, seq: Sequence, now: float) -> str | None:
        """Exercise 15.4: why the waiting `seq` must be refused now (a message), or None to keep it.

        Only with `self.reject` (--slo-reject), only a request that has no first token yet and has a TTFT
        target, and only when its laxity is below 0: even served from now on, its first token would be late.
        The message starts "TTFT deadline lost" and says how long it waited (ms), the target (ms), and the
        steps its prompt still needs.

            reject on, TTFT 500 ms, arrived 0.65, budget 4, step_s 0.1, now 1.0
            4-token prompt (laxity 0.05)        -> None
            12-token prompt (laxity -0.15)      -> "TTFT deadline lost: waited 350 ms ..., the target is 500 ms, ...3 more step(s)..."
        """
        raise NotImplementedError("Exercise 15.4: write SLOPolicy.reject_reason (see its docstring and README.md)")
