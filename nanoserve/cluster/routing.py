"""Chapter 16 — load-balancing policies as plain functions: which replica takes this request?

A policy sees what a router can know cheaply: each replica's queue length (requests it holds,
running or waiting — Ray Serve calls it "ongoing requests") and, for prefix affinity, which
replica last served which KV block (the chain hashes of chapter 05). Worked example, two replicas
with queue lengths {"a": 3, "b": 1}:

    round robin          a, b, a, b, ...                     blind to load
    least loaded         b                                   needs every queue length, every time
    power of two         pick 2 at random, take the shorter  two probes; (here: b, there are only two)
    prefix affinity      the replica holding the prompt's leading blocks, unless it is `imbalance`
                         requests busier than the least loaded one; then least loaded

The Ray Serve router (router.py) calls these with the queue lengths it caches for its replicas.
"""

import random
from collections.abc import Mapping, Sequence

ROUTERS = ("pow2", "prefix")  # what `serve --router` and deploy.fleet take (here, not in deploy: no Ray to list them)


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (the first one named, on a tie).

    >>> least_loaded({"a": 3, "b": 1, "c": 1})
    'b'
    """
    return min(queue_lens, key=queue_lens.__getitem__)


def power_of_two_choices(queue_lens: Mapping[str, int], rng: random.Random) -> str:
    """Sample two distinct replicas uniformly (`rng.sample(sorted(names), 2)`), return the one with the
    shorter queue (the first sampled on a tie). One replica: that one.

    Two random probes get almost all of least-loaded's benefit (the maximum queue drops from
    log n / log log n to log log n) while touching two replicas, not all of them.

    >>> power_of_two_choices({"a": 3, "b": 1}, random.Random(0))
    'b'
    """
    names = sorted(queue_lens)
    if len(names) == 1:
        return names[0]
    first, second = rng.sample(names, 2)
    return second if queue_lens[second] < queue_lens[first] else first


def prefix_affinity(block_hashes: Sequence[int], owner_of: Mapping[int, str], queue_lens: Mapping[str, int],
                    imbalance: int) -> tuple[str | None, int]:
    """(the replica to send to, how many leading blocks it holds), or (None, 0) when no live replica
    holds the first block (the caller then balances by load).

    The owner is the replica of the longest run of leading hashes that `owner_of` maps to one live
    replica (a name in queue_lens). It wins unless its queue is more than `imbalance` longer than the
    shortest queue: then affinity would pile work on one replica, and the least loaded one takes it.

        owner_of = {h0: "a", h1: "a"}   hashes [h0, h1, h2]   queue_lens {"a": 2, "b": 0}
        imbalance 4 -> ("a", 2)         imbalance 1 -> ("b", 0): a is 2 busier than b
    """
    owner, held = None, 0
    for i, h in enumerate(block_hashes):
        name = owner_of.get(h)
        if name is None or name not in queue_lens or (owner is not None and name != owner):
            break
        owner, held = name, i + 1
    if owner is None:
        return None, 0
    if queue_lens[owner] - min(queue_lens.values()) > imbalance:
        fallback = least_loaded(queue_lens)
        return fallback, 0
    return owner, held
