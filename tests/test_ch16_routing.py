"""Chapter 16 — the load-balancing policies (graded: 16.1 power of two choices, 16.2 prefix affinity).

Independent references: hand-worked cases, a replay of the same random generator, and least-loaded's
and random choice's maximum queue in a balls-into-bins simulation."""

import random

import pytest

from nanoserve.student import implementation


def policies():
    return implementation("nanoserve.cluster.routing")


@pytest.mark.exercise("16.1")
def test_power_of_two_picks_the_shorter_of_two_samples():
    p2c = policies().power_of_two_choices
    queues = {"a": 5, "b": 0, "c": 3, "d": 3}
    for seed in range(50):
        first, second = random.Random(seed).sample(sorted(queues), 2)  # the draw the contract names
        expect = second if queues[second] < queues[first] else first
        assert p2c(queues, random.Random(seed)) == expect, f"seed {seed}: sampled {first}, {second}"
    assert p2c({"only": 9}, random.Random(0)) == "only"


@pytest.mark.exercise("16.1")
def test_power_of_two_balances_almost_like_least_loaded():
    """Balls into bins: 10 replicas, 1000 requests that each stay. Random choice's fullest replica is far
    above the mean of 100; two choices stay within a few of it (the log log n result)."""
    p2c = policies().power_of_two_choices
    rng = random.Random(1)
    two, rand = dict.fromkeys("abcdefghij", 0), dict.fromkeys("abcdefghij", 0)
    for _ in range(1000):
        two[p2c(two, rng)] += 1
        rand[rng.choice(sorted(rand))] += 1
    assert sum(two.values()) == 1000
    assert max(two.values()) - 100 <= 3 < max(rand.values()) - 100


@pytest.mark.exercise("16.2")
def test_prefix_affinity_follows_the_longest_leading_run():
    affinity = policies().prefix_affinity
    owners = {1: "a", 2: "a", 3: "b", 7: "b"}
    queues = {"a": 2, "b": 0}
    assert affinity([1, 2, 3], owners, queues, imbalance=4) == ("a", 2)  # run stops where b's block starts
    assert affinity([1, 9, 2], owners, queues, imbalance=4) == ("a", 1)  # and at an unknown hash
    assert affinity([7, 1], owners, queues, imbalance=4) == ("b", 1)
    assert affinity([9, 1, 2], owners, queues, imbalance=4) == (None, 0)  # only the leading blocks count
    assert affinity([], owners, queues, imbalance=4) == (None, 0)


@pytest.mark.exercise("16.2")
def test_prefix_affinity_falls_back_when_the_owner_is_busy_or_gone():
    affinity = policies().prefix_affinity
    owners = {1: "a", 2: "a"}
    assert affinity([1, 2], owners, {"a": 2, "b": 0}, imbalance=2) == ("a", 2)  # 2 busier: still allowed
    assert affinity([1, 2], owners, {"a": 3, "b": 0, "c": 1}, imbalance=2) == ("b", 0)  # 3 busier: least loaded
    assert affinity([1, 2], owners, {"b": 4, "c": 1}, imbalance=2) == (None, 0)  # a died: not a live replica


@pytest.mark.exercise("16.2")
def test_prefix_affinity_in_a_routing_loop_keeps_each_prefix_on_one_replica():
    """Four system prompts, each a chain of 3 blocks; requests arrive in turn and are learned where they go
    (as PrefixAwareRouter.on_request_routed does). While queues stay level every prompt sticks to one
    replica; then one replica is loaded past the threshold and its prompts move."""
    mod = policies()
    rng = random.Random(0)
    owners, queues, placed = {}, {"r1": 0, "r2": 0}, {}
    for i in range(40):
        prompt = i % 4
        hashes = [prompt * 10 + b for b in range(3)]
        choice, _ = mod.prefix_affinity(hashes, owners, queues, imbalance=2)
        choice = choice or mod.power_of_two_choices(queues, rng)
        placed.setdefault(prompt, set()).add(choice)
        for h in hashes:
            owners[h] = choice
    assert all(len(where) == 1 for where in placed.values()), placed
    busy = next(iter(placed[0]))
    other = "r2" if busy == "r1" else "r1"
    assert mod.prefix_affinity([0, 1, 2], owners, {busy: 9, other: 0}, imbalance=2) == (other, 0)


def test_prefix_aware_router_ranks_the_owner_alone_until_it_is_really_overloaded():
    """The Ray Serve router itself (router.py), driven as Ray Serve drives it, without a cluster: two
    replicas, queue lengths in its own cache. The owner of a prompt's blocks is offered alone, try after
    try (a slow queue-length probe must not send the prompt to a cold replica); only after `owner_tries`
    failed tries, or when the owner is `imbalance` busier than the other, does the other replica get it.
    A new prefix is claimed when chosen, so a second request for it, routed before the first was
    accepted, follows it."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray.serve")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from nanoserve.cluster.router import PrefixAwareRouter

    def request(n: int, hashes: list[int]) -> PendingRequest:
        return PendingRequest(args=[], kwargs={"block_hashes": hashes},
                              metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))

    def ids(ranks) -> list[list[str]]:
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    async def scenario():
        dep = DeploymentID(name="LLMReplica", app_name="nanoserve")
        router = PrefixAwareRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN,
                                   use_replica_queue_len_cache=True)
        router.initialize_state(imbalance=2, owner_tries=3, seed=0)
        a, b = (SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=dep)) for name in "ab")
        queues = {"a": 0, "b": 0}

        async def ranks(pr):
            for r in (a, b):
                router.replica_queue_len_cache.update(r.replica_id, queues[r.replica_id.unique_id])
            return ids(await router.choose_replicas([a, b], pr))

        first = await ranks(request(0, [11, 12, 13]))  # nobody holds 11: power of two choices, both offered
        owner = first[0][0]
        other = "b" if owner == "a" else "a"
        assert first == [[owner], [other]]
        # routed before the first was accepted: the claim made when it was chosen already sends it there
        assert await ranks(request(1, [11, 12, 14])) == [[owner]]
        router.on_request_routed(request(0, [11, 12, 13]), ReplicaID(unique_id=owner, deployment_id=dep), None)
        retry = request(2, [11, 12, 15])
        queues[owner] = 2  # 2 busier than the other: still within imbalance 2
        assert [await ranks(retry) for _ in range(4)] == [[[owner]]] * 3 + [[[owner], [other]]]
        queues[owner] = 3  # 3 busier: the least loaded takes it, and from now on owns the prefix
        moved = request(3, [11, 12, 16])
        assert await ranks(moved) == [[other], [owner]]
        router.on_request_routed(moved, ReplicaID(unique_id=other, deployment_id=dep), None)
        queues[owner] = 0
        assert await ranks(request(4, [11, 12, 17])) == [[other]]
        assert await ranks(request(5, [99])) in ([["a"], ["b"]], [["b"], ["a"]])  # a new prefix: balanced
        assert router.decisions == {"owner": 5, "overloaded": 1, "unanswered": 1, "new": 2}
        router.on_replica_actor_died(ReplicaID(unique_id=other, deployment_id=dep))
        assert other not in router.owner_of.values() and 11 not in router.owner_of  # its blocks are gone with it

    asyncio.run(scenario())


def test_the_ingress_keeps_a_bounded_record_of_its_routing_decisions(monkeypatch):
    """ReplicaClient records (request id, replica) and each request's first block hash for inspection; a server
    that routes forever keeps only the last ROUTED_KEPT of them, in both records (a fake handle, no Ray)."""
    import asyncio
    from types import SimpleNamespace

    from nanoserve.cluster import client as client_module

    class Stream:  # what handle.generate.remote returns: the replica's first answer, then (here) no outputs
        def __init__(self, replica):
            self.replica = replica

        async def __anext__(self):
            return "accepted", self.replica

        def __aiter__(self):
            return self

        def cancel(self):
            pass

    calls = []
    remote = lambda request_id, *args, **kwargs: calls.append(request_id) or Stream(f"r{len(calls) % 2}")
    handle = SimpleNamespace(options=lambda **kw: SimpleNamespace(generate=SimpleNamespace(remote=remote)))
    monkeypatch.setattr(client_module, "ROUTED_KEPT", 5)
    client = client_module.ReplicaClient(handle, {"block_size": 4, "max_model_len": 64, "max_seq_len": 64})

    async def send(n):
        for i in range(n):
            prompt = [i] * 4 + [1, 2, 3, 4, 5]  # two full blocks before the last token; the first differs per request
            await client.add_request(f"q{i}", prompt, None)

    asyncio.run(send(12))
    assert calls == [f"q{i}" for i in range(12)]
    assert [rid for rid, _ in client.routed] == [f"q{i}" for i in range(7, 12)]
    assert [replica for _, replica in client.routed] == ["r0", "r1", "r0", "r1", "r0"]  # call 8 -> r0, ...
    assert list(client.first_block) == [f"q{i}" for i in range(7, 12)]
    expected = client_module.routing_hashes([11] * 4 + [1, 2, 3, 4, 5], 4)[0]
    assert client.first_block["q11"] == expected and len(set(client.first_block.values())) == 5
