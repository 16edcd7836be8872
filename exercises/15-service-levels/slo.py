"""Exercises 15.1 and 15.2 — the `slo` scheduling policy: deadlines instead of arrival order.

This file mirrors nanoserve/engine/policies/slo.py. Your class inherits the reference SLOPolicy, so what you
do not write is given: `targets(seq)` (the request's SLOTargets over its tenant's over the server's),
`deadline(seq)` (when its next token is due, on the scheduler's clock; +inf without a target), the budget
order of the running sequences and the --slo-reject check. The scheduler (chapter 06) calls your methods
once per step with `now`, its clock's time.

    15.1  order_waiting   admission: earliest deadline first
    15.2  choose_victim   preemption: the sequence that can best afford to lose its blocks

Each rung is graded alone (`make grade CH=15 EX=15.2`). README.md has the questions to answer first.
"""

from nanoserve.engine.policies.base import SLOTargets  # noqa: F401
from nanoserve.engine.policies.slo import SLOPolicy as ReferenceSLOPolicy
from nanoserve.engine.policies.slo import next_token_deadline  # noqa: F401
from nanoserve.engine.sequence import Sequence


class SLOPolicy(ReferenceSLOPolicy):
    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        """Exercise 15.1: a new list of the `waiting` sequences, the first to admit first.

        Earliest deadline first (`self.deadline(seq)`, seconds on the scheduler's clock, +inf for a request
        without a target). Equal deadlines — among them every request without targets — keep arrival order
        (`seq.arrival_time`), and a last tie is broken by `seq.seq_id`, so the order is total and reproducible.
        """
        raise NotImplementedError("Exercise 15.1: write SLOPolicy.order_waiting (see its docstring and README.md)")

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """Exercise 15.2: which of `candidates` (non-empty; running sequences not scheduled yet this step)
        to preempt when the pool is short.

        The one with the most slack, `self.deadline(seq) - now` (+inf without a target: best effort goes
        first); among equal slack, the latest arrival, then the largest seq_id. Return the sequence; the
        scheduler takes it out of the running set.
        """
        raise NotImplementedError("Exercise 15.2: write SLOPolicy.choose_victim (see its docstring and README.md)")
