"""Chapter 16 — routing policies: the state each decision of routing.py needs, behind one interface.

A policy answers one question per request and hears two kinds of news; it knows nothing of Ray:

    choose(block_hashes, queue_lens) -> Choice(replica, kind, sticky)
        block_hashes  the chain hashes of the prompt's leading full blocks (chapter 05; [] for a short prompt)
        queue_lens    {replica id: requests it holds}, the live replicas only
        kind          what decided, for the router's counts ("turn", "sampled", "owner", "new", ...)
        sticky        the replica holds something worth waiting for (cached blocks): offer it alone first
    routed(block_hashes, replica)   the replica accepted the request
    forget(replica)                 the replica is gone

router.py adapts any policy to Ray Serve's RequestRouter; `--router NAME` picks one from POLICIES. A new
policy is a class with these three methods and a line in POLICIES; one that scores replicas by the KV blocks they
report needs more than these arguments: a fleet here publishes no KV events (chapter 16, section 3).
"""

import importlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Choice:
    replica: str
    kind: str
    sticky: bool = False


class Policy:
    """The defaults: no news matters. `routing` is nanoserve.cluster.routing or the learner's mirror of it."""

    def __init__(self, routing: ModuleType, seed: int | None = None):
        self.routing, self.rng = routing, random.Random(seed)

    def choose(self, block_hashes: Sequence[int], queue_lens: Mapping[str, int]) -> Choice:
        raise NotImplementedError

    def routed(self, block_hashes: Sequence[int], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class RoundRobin(Policy):
    """a, b, a, b, ...: the baseline every load balancer starts from."""

    def __init__(self, routing: ModuleType, seed: int | None = None):
        super().__init__(routing, seed)
        self.turn = 0

    def choose(self, block_hashes, queue_lens) -> Choice:
        self.turn += 1
        return Choice(self.routing.round_robin(queue_lens, self.turn - 1), "turn")


class PowerOfTwo(Policy):
    """The shorter queue of two random replicas (Ray Serve's default idea)."""

    def choose(self, block_hashes, queue_lens) -> Choice:
        return Choice(self.routing.power_of_two_choices(queue_lens, self.rng), "sampled")


class PrefixAffinity(Policy):
    """A prompt goes where its leading KV blocks are (learned from where earlier requests went); a new
    prefix goes where the hash ring puts its first block, unless that replica is `imbalance` busier than
    the least loaded; a prompt without a full block, by power of two choices.

    The map is learned, not told: a request's hashes point at the replica chosen for it (claimed when
    chosen, so a second request routed before the first was accepted follows it) and then at the one that
    accepted it. max_hashes bounds the map (least recently routed forgotten first)."""

    def __init__(self, routing: ModuleType, seed: int | None = None, imbalance: int = 4, max_hashes: int = 1 << 16,
                 vnodes: int = 64):
        super().__init__(routing, seed)
        self.imbalance, self.max_hashes = imbalance, max_hashes
        self.owner_of: OrderedDict[int, str] = OrderedDict()  # block hash -> replica
        self.ring = routing.HashRing(vnodes=vnodes)

    def choose(self, block_hashes, queue_lens) -> Choice:
        if not block_hashes:
            return Choice(self.routing.power_of_two_choices(queue_lens, self.rng), "short")
        replica, held = self.routing.prefix_affinity(block_hashes, self.owner_of, queue_lens, self.imbalance)
        if held:
            return Choice(replica, "owner", sticky=True)
        kind = "overloaded" if replica is not None else "new"
        if replica is None:
            for name in self.ring.replicas - set(queue_lens):
                self.ring.remove(name)
            for name in set(queue_lens) - self.ring.replicas:
                self.ring.add(name)
            replica = self.ring.lookup(block_hashes[0])
            if queue_lens[replica] - min(queue_lens.values()) > self.imbalance:
                replica, kind = self.routing.least_loaded(queue_lens), "overloaded"
        self.routed(block_hashes, replica)
        return Choice(replica, kind)

    def routed(self, block_hashes, replica) -> None:
        for h in block_hashes:
            self.owner_of[h] = replica
            self.owner_of.move_to_end(h)
        while len(self.owner_of) > self.max_hashes:
            self.owner_of.popitem(last=False)

    def forget(self, replica) -> None:
        for h in [h for h, owner in self.owner_of.items() if owner == replica]:
            del self.owner_of[h]
        self.ring.remove(replica)


# --router NAME -> "module:class" (imported when chosen, so a policy may live in a later chapter's package)
POLICIES = {"round-robin": "nanoserve.cluster.policies:RoundRobin", "pow2": "nanoserve.cluster.policies:PowerOfTwo",
            "prefix": "nanoserve.cluster.policies:PrefixAffinity"}
ROUTERS = tuple(POLICIES)


def make_policy(name: str, routing: ModuleType, **kwargs) -> Policy:
    """POLICIES[name] built with the routing decisions to use and its own keyword arguments (an unknown one
    raises TypeError: nothing is dropped)."""
    if name not in POLICIES:
        raise ValueError(f"router must be one of {ROUTERS}, got {name!r}")
    module, cls = POLICIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(routing, **kwargs)
