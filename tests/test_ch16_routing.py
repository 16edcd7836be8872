"""Chapter 16 — the routing decisions (graded: 16.1 power of two choices, 16.2 the hash ring, 16.3 prefix
affinity), the policies around them, and the Ray Serve router that runs any of them.

Graded by behaviour only, never by replaying a random generator: hand cases, the probabilities two choices
give each queue rank (worked out by hand), the balls-into-bins bounds, a brute-force ring against the
learner's, and consistent hashing's invariants."""

import random
from collections import Counter

import pytest

from nanoserve.cluster.policies import make_policy
from nanoserve.student import implementation


def routing():
    return implementation("nanoserve.cluster.routing")


# ---- 16.1 power of two choices ---------------------------------------------------------------------------------

@pytest.mark.exercise("16.1")
def test_power_of_two_hand_cases():
    p2c = routing().power_of_two_choices
    for seed in range(20):  # two replicas: both are drawn, the shorter queue wins whatever the draw
        assert p2c({"a": 3, "b": 1}, random.Random(seed)) == "b"
        assert p2c({"a": 0, "b": 7}, random.Random(seed)) == "a"
    assert p2c({"only": 9}, random.Random(0)) == "only"
    queues = {"a": 5, "b": 0, "c": 3}
    p2c(queues, random.Random(0))
    assert queues == {"a": 5, "b": 0, "c": 3}  # read, not changed


@pytest.mark.exercise("16.1")
def test_power_of_two_chooses_each_rank_as_often_as_two_draws_predict():
    """Queues ranked 0 < 1 < 2 < 3 (n = 4): the rank-k replica wins when it is drawn with a longer one,
    P = (n - 1 - k) / C(n, 2): 3/6, 2/6, 1/6, 0. Equal queues: every replica 1/4. 6000 draws each; the
    tolerance (0.03) is more than four standard deviations."""
    p2c, rng, n = routing().power_of_two_choices, random.Random(7), 6000
    ranked = Counter(p2c({"a": 0, "b": 1, "c": 2, "d": 3}, rng) for _ in range(n))
    assert ranked["d"] == 0, "the longest queue can never win"
    for name, p in zip("abc", (3 / 6, 2 / 6, 1 / 6)):
        assert abs(ranked[name] / n - p) < 0.03, (name, ranked)
    level = Counter(p2c(dict.fromkeys("abcd", 2), rng) for _ in range(n))
    assert all(abs(level[name] / n - 1 / 4) < 0.03 for name in "abcd"), level


@pytest.mark.exercise("16.1")
def test_power_of_two_balls_into_bins():
    """Requests that stay where they are put. Heavily loaded (1000 on 10 replicas, mean 100): random choice's
    fullest replica is ~sqrt(2 (m/n) ln n) ≈ 21 above the mean, two choices' about ln ln n / ln 2 ≈ 1.2 above
    it. n = m = 1000: random's fullest holds ≈ ln n / ln ln n ≈ 3.6 (5 in practice), two choices' ln ln n /
    ln 2 ≈ 2.8."""
    p2c = routing().power_of_two_choices
    for seed in range(3):
        rng, names = random.Random(seed), [f"r{i}" for i in range(10)]
        two, rand = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        for _ in range(1000):
            two[p2c(two, rng)] += 1
            rand[rng.choice(names)] += 1
        assert sum(two.values()) == 1000
        assert max(two.values()) - 100 <= 3 < max(rand.values()) - 100, (two, rand)
    rng, names = random.Random(0), [f"r{i}" for i in range(1000)]
    two, rand = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for _ in range(1000):
        two[p2c(two, rng)] += 1
        rand[rng.choice(names)] += 1
    assert max(two.values()) <= 4 and max(two.values()) < max(rand.values()), (max(two.values()), max(rand.values()))


# ---- 16.2 the hash ring ------------------------------------------------------------------------------------------

def brute_force_owner(names, vnodes, key, point) -> str:
    """The replica of the first point at or after the key's, wrapping: the smallest clockwise distance."""
    k = point(str(key))
    return min(((point(f"{n}#{i}") - k) % 2 ** 64, n) for n in names for i in range(vnodes))[1]


@pytest.mark.exercise("16.2")
def test_hash_ring_matches_a_brute_force_ring():
    mod = routing()
    ring = mod.HashRing(["a", "b", "c"], vnodes=16)
    assert ring.replicas == {"a", "b", "c"}
    for key in list(range(300)) + [2 ** 200 + 17, "sys-prompt"]:
        assert ring.lookup(key) == brute_force_owner("abc", 16, key, mod.ring_point), key
    top = max(mod.ring_point(f"{n}#{i}") for n in "abc" for i in range(16))
    wrap = next(k for k in range(10_000) if mod.ring_point(str(k)) > top)  # past the last point: the first one's
    lowest = min((mod.ring_point(f"{n}#{i}"), n) for n in "abc" for i in range(16))[1]
    assert ring.lookup(wrap) == lowest
    with pytest.raises(LookupError):
        mod.HashRing([], vnodes=4).lookup(1)


@pytest.mark.exercise("16.2")
def test_hash_ring_moves_only_what_it_must():
    mod = routing()
    keys = range(2000)
    ring = mod.HashRing(["a", "b", "c"], vnodes=32)
    before = {k: ring.lookup(k) for k in keys}
    built = mod.HashRing(["c", "a"], vnodes=32)
    built.add("b")
    built.add("b")  # already there: nothing changes
    assert {k: built.lookup(k) for k in keys} == before  # the set of replicas decides, not the order
    ring.add("d")
    added = {k: ring.lookup(k) for k in keys}
    moved = [k for k in keys if added[k] != before[k]]
    assert moved and all(added[k] == "d" for k in moved)  # keys move only to the newcomer
    assert 0.1 < len(moved) / len(keys) < 0.45  # about 1/4 of them, where hash % n would move 3/4
    ring.remove("b")
    ring.remove("zzz")  # not there: nothing changes
    removed = {k: ring.lookup(k) for k in keys}
    assert all(removed[k] == added[k] for k in keys if added[k] != "b")  # only b's keys move
    assert "b" not in removed.values() and ring.replicas == {"a", "c", "d"}
    assert removed == {k: mod.HashRing(["a", "c", "d"], vnodes=32).lookup(k) for k in keys}


@pytest.mark.exercise("16.2")
def test_hash_ring_spreads_keys_over_its_replicas():
    ring = routing().HashRing(["a", "b", "c"], vnodes=64)
    shares = Counter(ring.lookup(k) for k in range(3000))
    assert set(shares) == {"a", "b", "c"} and all(0.2 < n / 3000 < 0.45 for n in shares.values()), shares


# ---- 16.3 prefix affinity ----------------------------------------------------------------------------------------

@pytest.mark.exercise("16.3")
def test_prefix_affinity_follows_the_longest_leading_run():
    affinity = routing().prefix_affinity
    owners = {1: "a", 2: "a", 3: "b", 7: "b"}
    queues = {"a": 2, "b": 0}
    assert affinity([1, 2, 3], owners, queues, imbalance=4) == ("a", 2)  # run stops where b's block starts
    assert affinity([1, 9, 2], owners, queues, imbalance=4) == ("a", 1)  # and at an unknown hash
    assert affinity([7, 1], owners, queues, imbalance=4) == ("b", 1)
    assert affinity([9, 1, 2], owners, queues, imbalance=4) == (None, 0)  # only the leading blocks count
    assert affinity([], owners, queues, imbalance=4) == (None, 0)


@pytest.mark.exercise("16.3")
def test_prefix_affinity_falls_back_when_the_owner_is_busy_or_gone():
    affinity = routing().prefix_affinity
    owners = {1: "a", 2: "a"}
    assert affinity([1, 2], owners, {"a": 2, "b": 0}, imbalance=2) == ("a", 2)  # 2 busier: still allowed
    assert affinity([1, 2], owners, {"a": 3, "b": 0, "c": 1}, imbalance=2) == ("b", 0)  # 3 busier: least loaded
    assert affinity([1, 2], owners, {"b": 4, "c": 1}, imbalance=2) == (None, 0)  # a died: not a live replica


@pytest.mark.exercise("16.3")
def test_prefix_affinity_in_a_routing_loop_keeps_each_prefix_on_one_replica():
    """Four system prompts, each a chain of 3 blocks, arrive in turn; where each goes is learned (as the
    prefix policy does). While queues stay level every prompt sticks to one replica; then one replica is
    loaded past the threshold and its prompts move."""
    mod = routing()
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


# ---- the policies (policies.py) ----------------------------------------------------------------------------------

def test_round_robin_takes_turns_whatever_the_load():
    from nanoserve.cluster import routing as reference

    policy = make_policy("round-robin", reference)
    picks = [policy.choose([], {"b": 9, "a": 0}) for _ in range(4)]
    assert [c.replica for c in picks] == ["a", "b", "a", "b"] and {c.kind for c in picks} == {"turn"}
    assert not any(c.sticky for c in picks)


def test_prefix_policy_places_new_prefixes_on_the_ring_and_follows_them():
    from nanoserve.cluster import routing as reference

    policy = make_policy("prefix", reference, imbalance=2, vnodes=16)
    level = {"a": 0, "b": 0}
    ring = reference.HashRing(["a", "b"], vnodes=16)
    first = policy.choose([11, 12, 13], level)
    assert (first.replica, first.kind, first.sticky) == (ring.lookup(11), "new", False)
    again = policy.choose([11, 12, 99], level)  # routed before the first was accepted: the claim holds
    assert (again.replica, again.kind, again.sticky) == (first.replica, "owner", True)
    # a second router with an empty map agrees on a new prefix: the ring needs no shared state
    assert make_policy("prefix", reference, imbalance=2, vnodes=16).choose([11], level).replica == first.replica
    other = "b" if first.replica == "a" else "a"
    busy = {first.replica: 3, other: 0}
    moved = policy.choose([11, 12, 14], busy)  # 3 busier than imbalance 2 allows: least loaded, which now owns it
    assert (moved.replica, moved.kind) == (other, "overloaded") and policy.owner_of[11] == other
    new_key = next(k for k in range(1000) if ring.lookup(k) == first.replica)
    assert policy.choose([new_key], busy) == type(moved)(other, "overloaded")  # the ring's pick is too busy
    policy.forget(other)
    assert other not in policy.owner_of.values() and 11 not in policy.owner_of
    alone = policy.choose([11, 12], {first.replica: 0})
    assert alone.replica == first.replica and policy.ring.replicas == {first.replica}
    assert policy.choose([], level).kind == "short"  # no full block: power of two choices


def test_make_policy_refuses_what_it_does_not_know():
    from nanoserve.cluster import routing as reference

    with pytest.raises(ValueError, match="router must be one of"):
        make_policy("random", reference)
    with pytest.raises(TypeError):
        make_policy("pow2", reference, imbalance=2)  # pow2 has no threshold: refused, not dropped


# ---- the Ray Serve router (router.py), driven as Ray Serve drives it, without a cluster ------------------------

def needs_ray() -> None:
    """Skip, naming the remedy, where Ray Serve is not installed (the router and the ingress import it)."""
    pytest.importorskip("ray.serve", reason="chapter 16's router and ingress run on Ray Serve: pip install 'ray[serve]'")


def drive_router(**state):
    """(router, ranks(request), request(n, hashes), routed(request, replica), dep): a PolicyRouter over two
    replicas "a" and "b" whose cached queue lengths are read from the dict `ranks` is given."""
    from types import SimpleNamespace

    needs_ray()
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from nanoserve.cluster.router import PolicyRouter

    dep = DeploymentID(name="LLMReplica", app_name="nanoserve")
    router = PolicyRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN,
                          use_replica_queue_len_cache=True)
    router.initialize_state(**state)
    replicas = [SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=dep)) for name in "ab"]

    def request(n: int, hashes: list[int]) -> PendingRequest:
        return PendingRequest(args=[], kwargs={"block_hashes": hashes},
                              metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))

    async def ranks(pr, queues) -> list[list[str]]:
        for r in replicas:
            router.replica_queue_len_cache.update(r.replica_id, queues[r.replica_id.unique_id])
        return [[r.replica_id.unique_id for r in rank] for rank in await router.choose_replicas(replicas, pr)]

    def routed(pr, name: str) -> None:
        router.on_request_routed(pr, ReplicaID(unique_id=name, deployment_id=dep), None)

    return router, ranks, request, routed, lambda name: ReplicaID(unique_id=name, deployment_id=dep)


def test_policy_router_ranks_the_owner_alone_until_it_is_really_overloaded():
    """The prefix policy under Ray Serve: the owner of a prompt's blocks is offered alone, try after try (a slow
    queue-length probe must not send the prompt to a cold replica); only after `owner_tries` failed tries, or
    when the owner is `imbalance` busier than the other, does the other replica get it."""
    import asyncio

    router, ranks, request, routed, replica_id = drive_router(policy="prefix", policy_kwargs={"imbalance": 2},
                                                              owner_tries=3, seed=0)

    async def scenario():
        queues = {"a": 0, "b": 0}
        first = await ranks(request(0, [11, 12, 13]), queues)  # nobody holds 11: the ring places it, both offered
        owner = first[0][0]
        other = "b" if owner == "a" else "a"
        assert first == [[owner], [other]]
        assert await ranks(request(1, [11, 12, 14]), queues) == [[owner]]  # claimed when chosen
        routed(request(0, [11, 12, 13]), owner)
        retry = request(2, [11, 12, 15])
        queues[owner] = 2  # 2 busier than the other: still within imbalance 2
        assert [await ranks(retry, queues) for _ in range(4)] == [[[owner]]] * 3 + [[[owner], [other]]]
        queues[owner] = 3  # 3 busier: the least loaded takes it, and from now on owns the prefix
        moved = request(3, [11, 12, 16])
        assert await ranks(moved, queues) == [[other], [owner]]
        routed(moved, other)
        queues[owner] = 0
        assert await ranks(request(4, [11, 12, 17]), queues) == [[other]]
        assert router.decisions == {"new": 1, "owner": 5, "unanswered": 1, "overloaded": 1}
        router.on_replica_actor_died(replica_id(other))
        assert other not in router.policy.owner_of.values() and 11 not in router.policy.owner_of

    asyncio.run(scenario())


def test_policy_router_round_robin_offers_the_rest_after_its_turn():
    import asyncio

    router, ranks, request, _, _ = drive_router(policy="round-robin")

    async def scenario():
        return [await ranks(request(n, []), {"a": 5, "b": 0}) for n in range(3)]

    assert asyncio.run(scenario()) == [[["a"], ["b"]], [["b"], ["a"]], [["a"], ["b"]]]
    assert router.decisions == {"turn": 3}


def test_the_ingress_keeps_a_bounded_record_of_its_routing_decisions(monkeypatch):
    """ReplicaClient records (request id, replica) and each request's first block hash for inspection; a server
    that routes forever keeps only the last ROUTED_KEPT of them, in both records (a fake handle, no Ray)."""
    needs_ray()
    import asyncio
    from types import SimpleNamespace

    from nanoserve.cluster import client as client_module

    class Stream:  # what handle.generate.remote returns: the replica's first answer, then (here) no outputs
        def __init__(self, replica):
            self.replica = replica

        async def __anext__(self):
            return "added", self.replica  # replica.py's protocol: ("added", replica id) or ("refused", why)

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


def test_the_ingress_refuses_a_first_message_outside_the_protocol():
    """A replica's first message is ("added", id) or ("refused", why); anything else (a replica of another
    version) is an error in one line, not a request recorded as routed to a replica named by chance."""
    needs_ray()
    import asyncio
    from types import SimpleNamespace

    from nanoserve.cluster.client import ReplicaClient
    from nanoserve.engine.async_engine import EngineUnavailable

    cancelled = []

    class Stream:
        async def __anext__(self):
            return "accepted", "r0"

        def cancel(self):
            cancelled.append(True)

    handle = SimpleNamespace(options=lambda **kw: SimpleNamespace(
        generate=SimpleNamespace(remote=lambda *args, **kwargs: Stream())))
    client = ReplicaClient(handle, {"block_size": 4, "max_model_len": 64, "max_seq_len": 64})
    with pytest.raises(EngineUnavailable, match="'accepted'") as error:
        asyncio.run(client.add_request("q0", [1, 2, 3], None))
    assert "\n" not in str(error.value)
    assert cancelled == [True] and client.num_unfinished_requests() == 0 and not client.routed


@pytest.fixture
def solved_16(tmp_path, monkeypatch):
    """A copy of exercises/ in which exercise 16's file is finished (the reference's code in it)."""
    import shutil

    from nanoserve import student
    from nanoserve.cluster import routing as reference

    root = tmp_path / "exercises"
    shutil.copytree(student.EXERCISES, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(student, "EXERCISES", root)
    shutil.copy(reference.__file__, root / student.STUDENT_FILES["nanoserve.cluster.routing"])


@pytest.mark.parametrize("policy", ["pow2", "prefix"])
def test_student_16_routes_through_the_ray_serve_router(solved_16, policy):
    """`--student 16`: the router Ray Serve calls runs the learner's decisions — power_of_two_choices under the
    default router (pow2), HashRing and prefix_affinity (and power_of_two_choices for short prompts) under
    prefix — and its report counts the calls."""
    import asyncio

    router, ranks, request, routed, _ = drive_router(policy=policy, student="16", seed=0)
    assert router.policy.routing.__name__ == "student_nanoserve_cluster_routing"

    async def scenario():
        for n in range(12):
            hashes = [100 + n % 3, 200 + n % 3] if n % 4 else []  # three prefixes, and short prompts
            chosen = (await ranks(request(n, hashes), {"a": n % 2, "b": 1}))[0][0]
            routed(request(n, hashes), chosen)

    asyncio.run(scenario())
    calls = router.student.calls
    if policy == "pow2":
        assert calls["power_of_two_choices"] == 12 and router.decisions == {"sampled": 12}
    else:
        assert calls["prefix_affinity"] == 9 and calls["power_of_two_choices"] == 3
        assert calls["HashRing.lookup"] == 3 and calls["HashRing.add"] == 2  # one new prefix each, two replicas
        assert router.decisions == {"short": 3, "new": 3, "owner": 6}
    assert "power_of_two_choices ×" in router.student.proof()
