"""Exercise 16 — load balancing: which replica takes this request? (mirrors nanoserve/cluster/routing.py)

A decision sees what a router can know cheaply: each replica's queue length (requests it holds, running or
waiting) and, for prefix affinity, which replica last took which KV block (chapter 05's chain hashes).
nanoserve/cluster/policies.py keeps the state around these decisions; nanoserve/cluster/router.py hands
them to Ray Serve (`serve --replicas 2 --router pow2|prefix --student 16`).

    given  least_loaded(queue_lens), round_robin(queue_lens, turn), ring_point(key)
    16.1   power_of_two_choices(queue_lens, rng)                            two random probes, the shorter queue
    16.2   HashRing(replicas, vnodes): add, remove, lookup                  consistent hashing
    16.3   prefix_affinity(block_hashes, owner_of, queue_lens, imbalance)   the prefix's replica, unless too busy
"""

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (the first one named, on a tie). Given: you may use it.

    >>> least_loaded({"a": 3, "b": 1, "c": 1})
    'b'
    """
    return min(queue_lens, key=queue_lens.__getitem__)


def round_robin(queue_lens: Mapping[str, int], turn: int) -> str:
    """The `turn`-th request's replica: the names in sorted order, one after the other. Given.

    >>> [round_robin({"b": 0, "a": 5}, t) for t in range(3)]
    ['a', 'b', 'a']
    """
    names = sorted(queue_lens)
    return names[turn % len(names)]


def ring_point(key: str) -> int:
    """Where `key` sits on the ring [0, 2**64): the first 8 bytes of its SHA-256, big-endian. Given.

    >>> ring_point("a#0")
    11569925936381117802
    """
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def power_of_two_choices(queue_lens: Mapping[str, int], rng: random.Random) -> str:
    """Exercise 16.1. Draw two *distinct* replicas uniformly at random (use `rng`, and only `rng`, for
    randomness) and return the one with the shorter queue; on a tie, either. One replica: return it.

    queue_lens: replica name -> requests it holds now (>= 1 replica). Not modified.

    What the tests check, by behaviour: with two replicas the shorter queue always wins; the longest of
    several distinct queues is never chosen; with queues ranked 0 < 1 < 2 < 3 the shortest is chosen half
    the time, the second a third, the third a sixth; equal queues are chosen equally often; and 1000
    requests on 10 replicas leave the fullest within a few of the mean, where random choice does not.

    >>> power_of_two_choices({"a": 3, "b": 1}, random.Random(0))
    'b'
    """
    raise NotImplementedError("Exercise 16.1: power_of_two_choices")


class HashRing:
    """Exercise 16.2. Consistent hashing: each replica owns `vnodes` points on a ring of 2**64 positions,
    at ring_point(f"{name}#{i}") for i in range(vnodes); `lookup(key)` returns the replica of the first
    point at or after ring_point(str(key)), wrapping around past the top to the lowest point.

    replicas: the initial names (any iterable of str). `self.replicas` is the set of names on the ring.
    add(name) / remove(name): put a replica's points on the ring / take them off (a name already there, or
    not there, is a no-op). lookup on an empty ring raises LookupError.

    Invariants the tests check: a key's replica depends only on the set of replicas, not on the order they
    were added; removing a replica moves only the keys it owned; adding one moves keys only to it; with 64
    vnodes each of 3 replicas owns between a fifth and nearly half of many keys.

    >>> ring = HashRing(["a", "b"], vnodes=8)
    >>> ring.lookup(12345), sorted(ring.replicas)
    ('b', ['a', 'b'])
    """

    def __init__(self, replicas: Iterable[str] = (), vnodes: int = 64):
        raise NotImplementedError("Exercise 16.2: HashRing.__init__")

    def add(self, name: str) -> None:
        raise NotImplementedError("Exercise 16.2: HashRing.add")

    def remove(self, name: str) -> None:
        raise NotImplementedError("Exercise 16.2: HashRing.remove")

    def lookup(self, key) -> str:
        raise NotImplementedError("Exercise 16.2: HashRing.lookup")


def prefix_affinity(block_hashes: Sequence[int], owner_of: Mapping[int, str], queue_lens: Mapping[str, int],
                    imbalance: int) -> tuple[str | None, int]:
    """Exercise 16.3. (the replica to send to, how many leading blocks it holds), or (None, 0) when no live
    replica holds the first block (the caller then places the new prefix).

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
    raise NotImplementedError("Exercise 16.3: prefix_affinity")
