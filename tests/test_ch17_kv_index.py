"""Chapter 17: the KV-aware router's index, fed by the replicas' real KV events over ZMQ, against what the
replicas' prefix caches really hold; its score by hand."""

import random
import time

import pytest

from nanoserve.disagg.kv_index import decode_event
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.kv_events import record_kv_events
from nanoserve.kv.prefix_cache import block_hashes
from nanoserve.sampling import SamplingParams
from nanoserve.server.kv_events import KVEventPublisher, encode_event
from nanoserve.student import implementation
from tests.kv_events_sync import PROBE, until_subscribed
from tests.tiny_model import tiny_llama


def kv_index():
    return implementation("nanoserve.disagg.kv_index")


def stored(*hashes):
    return ["BlockStored", list(hashes), None, [], 4, None, "GPU", None]


@pytest.mark.exercise("17.2")
def test_index_by_hand():
    index = kv_index().KVIndex()
    index.apply("a", stored(1, 2, 3))
    index.apply("b", stored(1, 2))
    index.apply("b", stored(9))
    assert index.longest_prefix([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    index.apply("a", ["BlockRemoved", [2], "GPU"])  # a gap: a's chain stops at block 0
    assert index.longest_prefix([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    index.apply("b", ["AllBlocksCleared"])
    assert index.longest_prefix([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 0}
    assert index.holders == {1: {"a"}, 3: {"a"}}, "a hash nobody holds leaves the index"
    index.apply("b", ["BlockRemoved", [3], "GPU"])  # b never held 3: nothing changes
    assert index.holders == {1: {"a"}, 3: {"a"}} and index.num_events == 6
    with pytest.raises(ValueError, match="unknown KV event"):
        index.apply("a", ["BlockMoved"])


@pytest.mark.exercise("17.3")
@pytest.mark.parametrize("matches, queues, cost, expected", [
    ({"a": 3, "b": 2}, {"a": 3, "b": 0}, 2, "b"),   # a: 3 - 6 = -3, b: 2 - 0 = 2
    ({"a": 3, "b": 2}, {"a": 0, "b": 0}, 2, "a"),   # no load: the longer chain
    ({"a": 3, "b": 2}, {"a": 1, "b": 0}, 1, "b"),   # a: 2, b: 2: the tie goes to the shorter queue
    ({}, {"b": 1, "a": 1}, 2, "a"),                 # nothing held, equal queues: the first name
    ({"a": 5}, {"a": 2, "b": 0, "c": 0}, 2, "a"),   # 5 - 4 = 1 beats 0
])
def test_router_score_by_hand(matches, queues, cost, expected):
    assert kv_index().choose_replica(matches, queues, cost) == expected


def test_wire_hashes_decode_back_to_ints():
    from nanoserve.kv.kv_events import BlockRemoved, BlockStored

    h, parent = (1 << 255) + 12345, 7
    assert decode_event(encode_event(BlockStored([h], parent, [1, 2], 2))) == ["BlockStored", [h], parent, [1, 2], 2,
                                                                               None, "GPU", None]
    assert decode_event(encode_event(BlockStored([h], None, [1, 2], 2, 3, lora_name="upper")))[5:] == [3, "GPU", "upper"]
    assert decode_event(encode_event(BlockRemoved([h]))) == ["BlockRemoved", [h], "GPU"]


@pytest.mark.exercise("17.2")
def test_index_from_events_is_what_the_caches_hold():
    """Two replicas with small pools (evictions happen), their publishers and one subscriber: after every
    event arrived, the index's replicas of each hash are exactly the replicas whose prefix cache holds it."""
    model = tiny_llama(vocab_size=97)
    engines = {n: LLMEngine(model, engine_config(block_size=4, num_blocks=12, max_num_batched_tokens=64))
               for n in ("r0", "r1")}
    logs = {n: record_kv_events(e.block_manager) for n, e in engines.items()}
    held = {n: log.take() for n, log in logs.items()}  # AllBlocksCleared: held back until the subscription is through
    publishers = {n: KVEventPublisher(logs[n], "tcp://127.0.0.1:*", topic=n) for n in engines}
    index = kv_index().KVIndex()
    subscriber = kv_index().KVEventSubscriber(index, {n: p.endpoint for n, p in publishers.items()})
    try:
        for n, p in publishers.items():  # each connection's subscription comes up on its own (ZMQ's slow joiner)
            until_subscribed(p, lambda timeout_ms, n=n: subscriber.poll(timeout_ms) >= 0 and
                             n + PROBE.decode() in subscriber.last_seq)
            for event in held[n]:
                logs[n].append(event)
        rng = random.Random(0)
        systems = [[rng.randrange(97) for _ in range(12)] for _ in range(4)]
        for i in range(24):
            name = rng.choice(["r0", "r1"])
            engine = engines[name]
            engine.add_request(str(i), systems[i % 4] + [rng.randrange(97)], SamplingParams(max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
        for p in publishers.values():
            p.flush()
        deadline = time.monotonic() + 60  # every batch is sent: wait until the last of each has arrived
        while any(subscriber.last_seq.get(n, -1) < p.seq - 1 for n, p in publishers.items()) \
                and time.monotonic() < deadline:
            subscriber.poll(100)
        assert sum(e.block_manager.stats.evicted_blocks for e in engines.values()) > 0, "the pools evicted"
        truth = {}
        for name, e in engines.items():
            for h in e.block_manager.prefix_cache.block_of_hash:
                truth.setdefault(h, set()).add(name)
        assert index.holders == truth
        assert subscriber.num_gaps == 0
        # and the chains: a system prompt's blocks, looked up on each replica as its own cache would
        for system in systems:
            hashes = block_hashes(system, 4)
            # (one token more: a lookup never hits a whole prompt, its last token must be computed)
            expect = {n: e.block_manager.lookup_prefix(system + [0]) // 4 for n, e in engines.items()}
            assert index.longest_prefix(hashes, engines) == expect
    finally:
        subscriber.close()
        for p in publishers.values():
            p.close()
