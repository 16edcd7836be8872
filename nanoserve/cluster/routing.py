"""Chapter 16 — load-balancing decisions as plain functions: which replica takes this request?

A decision sees what a router can know cheaply: each replica's queue length (requests it holds,
running or waiting — Ray Serve calls it "ongoing requests") and, for prefix affinity, which
replica last served which KV block (the chain hashes of chapter 05). Worked example, two replicas
with queue lengths {"a": 3, "b": 1}:

    round robin          a, b, a, b, ...                     blind to load
    least loaded         b                                   needs every queue length, every time
    power of two         pick 2 at random, take the shorter  two probes; (here: b, there are only two)
    hash ring            the replica after the key's point   no state to share: every router agrees
    prefix affinity      the replica holding the prompt's leading blocks, unless it is `imbalance`
                         requests busier than the least loaded one; then least loaded

policies.py keeps the state these need (a turn counter, an owner map, a ring) behind one interface;
router.py hands them to Ray Serve.
"""

import bisect
import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (the first one named, on a tie).

    >>> least_loaded({"a": 3, "b": 1, "c": 1})
    'b'
    """
    return min(queue_lens, key=queue_lens.__getitem__)


def round_robin(queue_lens: Mapping[str, int], turn: int) -> str:
    """The `turn`-th request's replica: the names in sorted order, one after the other, queues ignored.

    >>> [round_robin({"b": 0, "a": 5}, t) for t in range(3)]
    ['a', 'b', 'a']
    """
    names = sorted(queue_lens)
    return names[turn % len(names)]


def power_of_two_choices(queue_lens: Mapping[str, int], rng: random.Random) -> str:
    """Two distinct replicas drawn uniformly at random; the one with the shorter queue (either on a tie).
    One replica: that one.

    Two random probes get almost all of least-loaded's benefit: n requests on n replicas leave the fullest
    with about ln n / ln ln n at random, ln ln n / ln 2 with two choices (chapter 16, section 3).

    >>> power_of_two_choices({"a": 3, "b": 1}, random.Random(0))
    'b'
    """
    names = sorted(queue_lens)
    if len(names) == 1:
        return names[0]
    first, second = rng.sample(names, 2)
    return second if queue_lens[second] < queue_lens[first] else first


def ring_point(key: str) -> int:
    """Where `key` sits on the ring [0, 2**64): the first 8 bytes of its SHA-256, big-endian.

    >>> ring_point("a#0")
    11569925936381117802
    """
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class HashRing:
    """Consistent hashing (Karger et al., 1997): each replica owns `vnodes` points on a ring, at
    ring_point(f"{name}#{i}") for i < vnodes; a key goes to the replica of the first point at or after
    ring_point(str(key)), wrapping past the top. Adding a replica moves only the keys it takes; removing
    one moves only its own keys — where `hash % n` would move almost all of them.

    >>> ring = HashRing(["a", "b"], vnodes=8)
    >>> ring.lookup(12345), sorted(ring.replicas)
    ('b', ['a', 'b'])
    """

    def __init__(self, replicas: Iterable[str] = (), vnodes: int = 64):
        self.vnodes = vnodes
        self.points: list[int] = []   # sorted vnode points
        self.owner: dict[int, str] = {}  # point -> replica
        self.replicas: set[str] = set()
        for name in replicas:
            self.add(name)

    def add(self, name: str) -> None:
        if name in self.replicas:
            return
        self.replicas.add(name)
        for i in range(self.vnodes):
            point = ring_point(f"{name}#{i}")
            self.owner[point] = name
            bisect.insort(self.points, point)

    def remove(self, name: str) -> None:
        if name not in self.replicas:
            return
        self.replicas.discard(name)
        self.points = [p for p in self.points if self.owner[p] != name]
        self.owner = {p: self.owner[p] for p in self.points}

    def lookup(self, key) -> str:
        """The replica that owns `key` (any value; its str() is hashed). The ring must not be empty."""
        if not self.points:
            raise LookupError("the ring has no replicas")
        i = bisect.bisect_left(self.points, ring_point(str(key)))
        return self.owner[self.points[i % len(self.points)]]


def prefix_affinity(block_hashes: Sequence[int], owner_of: Mapping[int, str], queue_lens: Mapping[str, int],
                    imbalance: int) -> tuple[str | None, int]:
    """(the replica to send to, how many leading blocks it holds), or (None, 0) when no live replica
    holds the first block (the caller then places the new prefix: policies.py uses the hash ring).

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
        return least_loaded(queue_lens), 0
    return owner, held
