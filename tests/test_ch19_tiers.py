"""Chapter 19: adapters as a tier — the slots' LRU (hand-worked), memory and disk tiers, the scheduler's
admission by adapter slot (no more than max_loras adapters in the running set, nobody starved), and prefix-cache
chains keyed by adapter."""

from collections import OrderedDict

import pytest
import torch

from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.block_manager import BlockManager
from nanoserve.lora.adapter import LoRAAdapter
from nanoserve.engine.config import LoRAConfig
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation
from tests.lora_reference import TINY, tiny_llama


def manager_module():
    return implementation("nanoserve.lora.manager")


@pytest.mark.exercise("19.3")
def test_lru_slots_by_hand():
    lru = manager_module().lru_slots
    slots = OrderedDict()
    assert lru(slots, {"a"}, 2) == {"a": 1} and list(slots.items()) == [("a", 1)]
    assert lru(slots, {"a", "b"}, 2) == {"b": 2} and list(slots.items()) == [("a", 1), ("b", 2)]
    assert lru(slots, {"b", "c"}, 2) == {"c": 1} and list(slots.items()) == [("b", 2), ("c", 1)]  # a was LRU
    assert lru(slots, {"b"}, 2) == {} and list(slots.items()) == [("c", 1), ("b", 2)]  # a use moves b last
    assert lru(slots, {"d", "a"}, 2) == {"a": 1, "d": 2} and list(slots.items()) == [("a", 1), ("d", 2)]


@pytest.mark.exercise("19.3")
def test_lru_slots_keep_what_the_step_needs_and_fill_free_slots_first():
    lru = manager_module().lru_slots
    slots = OrderedDict([("x", 2), ("y", 3)])  # slot 1 is free (its adapter was unloaded)
    assert lru(slots, {"z"}, 3) == {"z": 1}
    assert lru(slots, {"x", "w"}, 3) == {"w": 3} and list(slots) == ["z", "x", "w"]  # y: LRU and not needed


def fake_adapter(name: str, path: str, model_config, max_rank: int, modules) -> LoRAAdapter:
    """An adapter of rank 1 on layer 0's q_proj whose A and B hold `len(name)` (no file read)."""
    v = float(len(name))
    return LoRAAdapter(name, path, 1, 1.0, {"layers.0.self_attn.q_proj": (torch.full((1, TINY.hidden_size), v),
                                                                           torch.full((64, 1), v))})


@pytest.mark.exercise("19.3")
def test_tiers_slots_memory_and_disk():
    """max_loras 1, max_cpu_loras 2: three adapters; who is read from disk again, who is only copied."""
    reads = []
    loader = lambda *args: reads.append(args[0]) or fake_adapter(*args)  # noqa: E731
    m = manager_module().LoRAModelManager(tiny_llama(), LoRAConfig(max_loras=1, max_lora_rank=4, max_cpu_loras=2),
                                          load=loader)
    for name in ("a", "bb", "ccc"):
        m.add_adapter(name, f"/adapters/{name}")  # each read once; memory keeps the last two
    assert reads == ["a", "bb", "ccc"] and list(m.cpu) == ["bb", "ccc"]
    layer = m.layers["layers.0.self_attn.qkv_proj"]
    m.set_step([("bb", 2), (None, 1)])  # from memory: no read
    assert reads == ["a", "bb", "ccc"] and m.slots == {"bb": 1}
    assert layer.lora_a[1, 0, 0] == 2 and torch.equal(m.mapping.token_slots, torch.tensor([1, 1, 0]))
    m.set_step([("a", 1)])  # from disk again (memory had dropped it), into bb's slot
    assert reads[-1] == "a" and m.slots == {"a": 1} and layer.lora_a[1, 0, 0] == 1
    assert len(m.load_seconds["disk"]) == 4 and len(m.load_seconds["slot"]) == 2
    with pytest.raises(RuntimeError, match="max_loras is 1"):
        m.set_step([("a", 1), ("bb", 1)])


@pytest.mark.exercise("19.3")
def test_an_adapter_in_a_slot_stays_in_memory():
    """max_loras 1, max_cpu_loras 1: a sits in the slot; bb is read and checked but memory keeps a, so a's next
    step reads nothing; bb's step reads bb again and, a now out of the slot, memory keeps bb."""
    reads = []
    loader = lambda *args: reads.append(args[0]) or fake_adapter(*args)  # noqa: E731
    m = manager_module().LoRAModelManager(tiny_llama(), LoRAConfig(max_loras=1, max_lora_rank=4, max_cpu_loras=1),
                                          load=loader)
    m.add_adapter("a", "/adapters/a")
    m.set_step([("a", 1)])
    m.add_adapter("bb", "/adapters/bb")
    assert reads == ["a", "bb"] and list(m.cpu) == ["a"] and m.slots == {"a": 1}
    m.set_step([("a", 2)])
    assert reads == ["a", "bb"]  # in the slot and in memory: nothing read
    m.set_step([("bb", 1)])
    assert reads == ["a", "bb", "bb"] and list(m.cpu) == ["bb"] and m.slots == {"bb": 1}


def seq(seq_id: str, lora: str | None, arrival: float) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], 2, 0, arrival, SamplingParams(max_tokens=2), lora_name=lora)


def test_the_scheduler_admits_no_adapter_beyond_the_slots_and_starves_none():
    """max_loras 1: a1 (adapter a) runs; b1 waits at the head, and a2 (adapter a again) behind it waits too —
    strict FCFS, so b1 is not overtaken forever; once a1 finishes, b1 runs."""
    s = Scheduler(SchedulerConfig(8, 64), BlockManager(16, 4, enable_prefix_caching=False), max_loras=1)
    for i, (sid, lora) in enumerate([("a1", "a"), ("base", None), ("b1", "b"), ("a2", "a")]):
        s.add_seq(seq(sid, lora, float(i)))
    out = s.schedule()
    assert [q.seq_id for q in out.scheduled_seqs] == ["a1", "base"]
    assert [q.seq_id for q in s.waiting] == ["b1", "a2"]
    s.finish_seq("a1", s.seqs["a1"].status.FINISHED_STOPPED)
    out = s.schedule()
    assert "b1" in [q.seq_id for q in out.scheduled_seqs] and [q.seq_id for q in s.waiting] == ["a2"]


def test_prefix_cache_blocks_are_never_shared_across_adapters(tiny_adapters):
    """The same 12-token prompt under adapter a, adapter b, a again and the base: only the repeat of a hits; a
    unloaded and loaded again under its name hits none of the old a's blocks."""
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=32, block_size=4,
                                                  lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)), eos_token_id=-1)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    hits = []

    def run(i, lora):
        before = engine.block_manager.stats.hit_blocks
        engine.add_request(str(i), list(range(10, 22)), SamplingParams(max_tokens=1), lora_name=lora)
        while engine.has_unfinished_requests():
            engine.step()
        hits.append(engine.block_manager.stats.hit_blocks - before)

    for i, lora in enumerate(["a", "b", "a", None]):
        run(i, lora)
    assert hits == [0, 0, 2, 0]  # 12 tokens: 3 full blocks, the last one recomputed to sample (2 hits)
    engine.remove_lora("a")  # a reloaded under the same name is a new adapter (a new id): a's blocks never hit
    engine.add_lora("a", tiny_adapters["a"])
    run(4, "a")
    run(5, "a")
    assert hits[4:] == [0, 2]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=1), lora_name="c")


def test_vllm_lora_requests_info_names_running_and_waiting_adapters(tiny_adapters):
    """--metrics-compat vllm: after a step with max_loras 1, adapter a runs and b waits (the scheduler's slot rule)."""
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.server.metrics import PrometheusStatLogger

    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=32, lora_config=LoRAConfig(max_loras=1, max_lora_rank=8)),
                       eos_token_id=-1)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    for rid, lora in (("1", "a"), ("2", "b"), ("3", None)):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=3), lora_name=lora)
    logger = PrometheusStatLogger("tiny", "vllm")
    logger.record(engine, engine.step(), engine.last_scheduler_output)
    lines = [line for line in logger.scrape().decode().splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1
    assert 'max_lora="1"' in lines[0] and 'running_lora_adapters="a"' in lines[0]
    assert 'waiting_lora_adapters="b"' in lines[0]


def test_kv_events_carry_the_adapter_in_vllms_wire_format(tiny_adapters):
    """Chapter 16's publisher, decoded with msgpack alone by vLLM's field order: BlockStored is [tag, hashes, parent,
    token_ids, block_size, lora_id, medium, lora_name]. One prompt under a, b and the base: each adapter's blocks name
    it (and its id, a new one when it is loaded again), the base's say None and are chapter 05's plain chain."""

    import msgpack
    import zmq

    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.kv.kv_events import record_kv_events
    from nanoserve.kv.prefix_cache import block_hashes
    from nanoserve.server.kv_events import KVEventPublisher
    from tests.kv_events_sync import is_probe, probe_on, until_subscribed

    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=32, block_size=4,
                                                  lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)), eos_token_id=-1)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    log = record_kv_events(engine.block_manager)
    held = log.take()  # AllBlocksCleared: held back until the subscription is through
    # the test flushes each batch itself (a publisher thread flushing on its clock could split a request's events)
    publisher = KVEventPublisher(log, "tcp://127.0.0.1:*", interval_s=3600)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(publisher.endpoint)
    until_subscribed(publisher, probe_on(sub))  # PUB drops what it sends before that ("slow joiner")
    for event in held:
        log.append(event)
    publisher.flush()  # AllBlocksCleared's batch
    prompt = list(range(10, 22))  # 3 full blocks of 4
    ids = {}
    for i, lora in enumerate(["a", "b", None, "reload a"]):
        if lora == "reload a":
            engine.remove_lora("a")
            engine.add_lora("a", tiny_adapters["a"])
            lora = "a"
        ids[i] = engine.lora_ids.get(lora)
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1), lora_name=lora)
        while engine.has_unfinished_requests():
            engine.step()
        publisher.flush()  # one batch per request
    publisher.close()
    batches = []
    while len(batches) < 5 and sub.poll(60_000):  # AllBlocksCleared's, then one per request: all sent, on their way
        topic, _, payload = sub.recv_multipart()
        if not is_probe(topic):
            batches.append([e for e in msgpack.unpackb(payload, raw=False)[1] if e[0] == "BlockStored"])
    sub.close()
    stored = batches[1:]
    assert [len(b) for b in stored] == [3, 3, 3, 3]
    for i, (lora, events) in enumerate(zip(["a", "b", None, "a"], stored)):
        for tag, hashes, parent, tokens, size, lora_id, medium, lora_name in events:
            assert (size, medium, lora_name, lora_id) == (4, "GPU", lora, ids[i])
    assert ids[0] != ids[3] and None not in (ids[0], ids[1], ids[3])  # a reloaded: a new id under the same name
    base = [int.from_bytes(e[1][0], "little") for e in stored[2]]
    assert base == block_hashes(prompt, 4) and stored[2][0][2] is None  # the base's chain starts at no parent
    chains = [{e[1][0] for e in events} for events in stored]
    assert all(not (chains[i] & chains[j]) for i in range(4) for j in range(i + 1, 4))  # no block shared
