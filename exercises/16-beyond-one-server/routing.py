"""Exercise 16 — load-balancing policies: which replica takes this request? (mirrors nanoserve/cluster/routing.py)

A policy sees what a router can know cheaply: each replica's queue length (requests it holds, running or
waiting) and, for prefix affinity, which replica last took which KV block (chapter 05's chain hashes).
The Ray Serve router (nanoserve/cluster/router.py) calls these with the queue lengths it caches.

    16.1  power_of_two_choices(queue_lens, rng)                           two random probes, the shorter queue
    16.2  prefix_affinity(block_hashes, owner_of, queue_lens, imbalance)  the prefix's replica, unless too busy
"""

import random
from collections.abc import Mapping, Sequence


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (the first one named, on a tie). Given: you may use it.

    >>> least_loaded({"a": 3, "b": 1, "c": 1})
    'b'
    """
    return min(queue_lens, key=queue_lens.__getitem__)


def power_of_two_choices(queue_lens: Mapping[str, int], rng: random.Random) -> str:
    """Exercise 16.1. Sample two distinct replicas uniformly with `rng.sample(sorted(queue_lens), 2)` (that
    exact call: the tests replay the generator), and return the one with the shorter queue — the first
    sampled on a tie. With a single replica, return it without drawing.

    queue_lens: replica name -> requests it holds now (>= 1 replica).

    >>> power_of_two_choices({"a": 3, "b": 1}, random.Random(0))
    'b'
    """
    raise NotImplementedError("Exercise 16.1: power_of_two_choices")


def prefix_affinity(block_hashes: Sequence[int], owner_of: Mapping[int, str], queue_lens: Mapping[str, int],
                    imbalance: int) -> tuple[str | None, int]:
    """Exercise 16.2. (the replica to send to, how many leading blocks it holds), or (None, 0) when no live
    replica holds the first block (the caller then balances by load).

    block_hashes: the chain hashes of the prompt's leading full blocks, in order.
    owner_of: block hash -> the replica that took the last request with that block.
    queue_lens: the live replicas (only these may be chosen) -> their queue lengths.

    The owner is the replica of the longest run of *leading* hashes that owner_of maps to one and the same
    live replica (the run stops at the first hash that is unknown, dead, or another replica's). It wins
    unless its queue is more than `imbalance` longer than the shortest queue; then the least loaded
    replica takes the request, holding 0 of its blocks.

        owner_of = {h0: "a", h1: "a"}   hashes [h0, h1, h2]   queue_lens {"a": 2, "b": 0}
        imbalance 4 -> ("a", 2)         imbalance 1 -> ("b", 0): a is 2 busier than b
    """
    raise NotImplementedError("Exercise 16.2: prefix_affinity")
