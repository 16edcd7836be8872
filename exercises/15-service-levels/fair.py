"""Exercise 15.3 — weighted fair sharing of a step's token budget across tenants.

This file mirrors nanoserve/engine/policies/fair.py. The FairPolicy below is the reference's, except that it
orders with your `fair_order`: the scheduler spends the step's token budget on the running sequences in
that order, and admits waiting ones in that order. The policy keeps each tenant's virtual time (tokens
served / weight) and charges it after every scheduled chunk; you only order.

    tenants a and b, weight 1 each, virtual times a=0, b=0; a's decodes a1 a2 a3 (arrival order), b's b1
    fair_order -> [a1, b1, a2, a3]

Graded with `make grade CH=15`. README.md has the questions to answer first.
"""

from nanoserve.engine.policies.fair import FairPolicy as ReferenceFairPolicy
from nanoserve.engine.policies.fair import remaining_tokens
from nanoserve.engine.sequence import Sequence


def fair_order(seqs: list[Sequence], virtual_time: dict, weights: dict, cost=remaining_tokens) -> list[Sequence]:
    """Exercise 15.3: `seqs` in weighted-fair order (a new list holding each of them once).

    Group the sequences by `seq.tenant` (None is a tenant too), each group in arrival order (`arrival_time`,
    then `seq_id`). Repeatedly take the next sequence of the tenant whose projected virtual time is the
    lowest (ties: the smaller `str(tenant)`); that tenant's projected time then grows by
    `cost(seq) / weights.get(tenant, 1.0)`. Projected times start at `virtual_time.get(tenant, 0.0)`.
    Do not modify `virtual_time`: the policy charges what is actually scheduled.
    """
    raise NotImplementedError("Exercise 15.3: write fair_order (see its docstring and README.md)")


class FairPolicy(ReferenceFairPolicy):
    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        return fair_order(seqs, self.virtual_time, self.weights)
