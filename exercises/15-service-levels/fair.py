"""Exercises 15.5 and 15.6 — weighted fair sharing of a step's token budget across tenants.

This file mirrors nanoserve/engine/policies/fair.py. The FairPolicy below is the reference's, except for
what you write: the order (15.5, `fair_order`: the scheduler spends the step's token budget on the running
sequences in that order, and admits waiting ones in that order) and the accounting that order reads (15.6:
each tenant's virtual time, charged after every scheduled chunk, caught up when a tenant comes back).

    tenants a and b, weight 1 each, virtual times a=0, b=0; a's decodes a1 a2 a3 (arrival order), b's b1
    fair_order -> [a1, b1, a2, a3]

Graded with `make grade CH=15`. README.md has the questions to answer first.
"""

import heapq  # noqa: F401  (a heap keyed by virtual time is one way; a sort per pick is another)

from nanoserve.engine.policies.base import arrival_order  # noqa: F401  (arrival_order(seq): (arrival_time, seq_id))
from nanoserve.engine.policies.fair import FairPolicy as ReferenceFairPolicy
from nanoserve.engine.policies.fair import remaining_tokens
from nanoserve.engine.sequence import Sequence


def fair_order(seqs: list[Sequence], virtual_time: dict, weights: dict, cost=remaining_tokens) -> list[Sequence]:
    """Exercise 15.5: `seqs` in weighted-fair order (a new list holding each of them once).

    Contract: the order in which a weighted-fair server would serve them, if each one served cost(seq) tokens.
    - Within a tenant (`seq.tenant`; None is a tenant too), arrival order (`arrival_order`).
    - Each pick goes to the tenant that, counting what the picks before it in this list would serve, has
      been served least for its weight: its virtual time (`virtual_time`, missing: 0) plus its picked costs
      over its weight (`weights`, missing: 1). Ties: the smaller `str(tenant)`.
    - `virtual_time` is not modified: the policy charges what is actually scheduled (15.6).

        decodes a1 a2 a3 b1, virtual_time {}, weights {}                  -> a1 b1 a2 a3
        decodes a1 a2 b1 b2 b3, virtual_time {"a": 2.0}                   -> b1 b2 a1 b3 a2
        decodes a1 a2 a3 b1 b2, weights {"a": 2.0}                        -> a1 b1 a2 a3 b2
    """
    raise NotImplementedError("Exercise 15.5: write fair_order (see its docstring and README.md)")


class FairPolicy(ReferenceFairPolicy):
    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        return fair_order(seqs, self.virtual_time, self.weights)  # yours (given)

    def catch_up(self, busy: set) -> None:
        """Exercise 15.6: called once a step with `busy`, the tenants that have work now (running or waiting).

        `self._busy` holds the set of the previous call (empty at first). A tenant busy now but not then (new,
        or back from idle) has its `self.virtual_time` raised to the lowest virtual time of the tenants busy
        both then and now — never lowered, and left alone when no tenant was busy both times (missing: 0).
        Then remember `busy` for the next call.

            virtual_time {a: 1.75, b: 10}, _busy {a, b}; busy {a, b, c}      -> c: 1.75
            virtual_time {a: 1.75, b: 30}, _busy {b};    busy {a, b}         -> a: 30 (idle is not credit)
        """
        raise NotImplementedError("Exercise 15.6: write FairPolicy.catch_up (see its docstring and README.md)")

    def on_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """Exercise 15.6: `num_tokens` of `seq` go into this step: charge its tenant for them.

        Contract: a tenant's virtual time (`self.virtual_time`, missing: 0) is the tokens it was served over
        its weight (`self.weights`, missing: 1), so after the call its tenant's entry has grown by exactly
        that charge and no other tenant's has changed.

            weights {a: 4}: a charged 7 tokens from nothing   -> a: 1.75
            no weight for b: b charged 7, then 3               -> b: 10.0
        """
        raise NotImplementedError("Exercise 15.6: write FairPolicy.on_scheduled (see its docstring and README.md)")
