"""Chapter 16 — KV-cache events in vLLM's format, and vLLM's metric names (the protocol fleet routers speak).

The subscriber decodes with msgpack alone (vLLM's schema written out by hand) and rebuilds the set of
cached blocks from the events; it must equal what the block manager's prefix cache holds."""

import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.prefix_cache import block_hashes
from nanoserve.kv.kv_events import AllBlocksCleared, record_kv_events
from nanoserve.sampling import SamplingParams
from nanoserve.server.kv_events import KVEventPublisher
from nanoserve.server.runner import serving
from tests.kv_events_sync import is_probe, probe_on, until_subscribed
from tests.tiny_model import paced_tiny_llama, tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=49152)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def subscribe(endpoint: str):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return ctx, sub


def test_kv_events_match_the_block_manager(tiny):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=12, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_seqs=2)))
    log = record_kv_events(engine.block_manager)
    held = log.take()  # AllBlocksCleared: held back until the subscription is through
    publisher = KVEventPublisher(log, "tcp://127.0.0.1:*")
    ctx, sub = subscribe(publisher.endpoint)
    until_subscribed(publisher, probe_on(sub))  # PUB drops what it sends before that ("slow joiner")
    for event in held:
        log.append(event)
    shared = list(range(10, 22))  # 3 full blocks of 4
    prompts = [shared + [1, 2, 3, 4, 5], shared + [6, 7], list(range(40, 70))]  # the third forces evictions
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    publisher.close()
    batches, seqs = [], []
    sub.setsockopt(zmq.RCVTIMEO, 60_000)  # every batch sent is on its way: wait for them all, however slow the machine
    while len(batches) < publisher.seq:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            break  # lost: the asserts below say so
        if is_probe(topic):
            continue
        seqs.append(int.from_bytes(seq, "big"))
        batches.append(msgpack.unpackb(payload, raw=False))
    sub.close()
    ctx.term()
    assert seqs == list(range(publisher.seq)) and seqs, "numbered batches, none lost"
    events = [e for ts, evs in batches for e in evs]
    assert events[0] == ["AllBlocksCleared"]
    cached, kinds = {}, set()
    for e in events[1:]:
        kinds.add(e[0])
        if e[0] == "BlockStored":
            _, hashes, parent, tokens, size, lora_id, medium, lora_name = e
            assert size == 4 and len(tokens) == 4 and lora_id is None and lora_name is None
            assert parent is None or parent in cached, "a stored block's parent was stored before it"
            cached[hashes[0]] = (parent, tokens)
        elif e[0] == "BlockRemoved":
            for h in e[1]:
                del cached[h]
    assert kinds == {"BlockStored", "BlockRemoved"}, "12 blocks cannot hold all three prompts: evictions"
    entries = engine.block_manager.prefix_cache.entries  # the block manager's own record
    assert {h.to_bytes(32, "little"): (None if p is None else p.to_bytes(32, "little"), list(t))
            for h, p, t in entries.values()} == cached
    # the hashes are chapter 05's chain over the prompt: the first stored block is the shared prefix's
    first = block_hashes(shared, 4)[0].to_bytes(32, "little")
    assert next(e for e in events if e[0] == "BlockStored")[1] == [first]


def vllm_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
            assert 'model_name="tiny"' in name
    return values


def test_vllm_gauges_mid_request_match_the_block_manager(tokenizer):
    """Scraped while a request decodes (a paced model: 0.2 s a step): one running request, holding one block of
    the 16 (a 4-token prompt plus 8 tokens fit in one block of 16), so kv_cache_usage_perc is 1/16 — the block
    manager's own usage."""
    import threading

    model = paced_tiny_llama(0.2, vocab_size=49152)
    # past its prefill, the request's steps wait until the test has scraped and read the block manager (a bounded
    # wait): the request cannot end between the scrape and the read, however slow the machine
    forward, passes, scraped = model.forward, [0], threading.Event()

    def held(*args, **kwargs):
        passes[0] += 1
        if passes[0] > 1:
            scraped.wait(60)
        return forward(*args, **kwargs)

    model.forward = held
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=16),
                                           scheduler_config=SchedulerConfig(max_num_seqs=2)), tokenizer)
    manager = engine.block_manager
    with serving(engine, tokenizer, model_name="tiny", metrics_compat="vllm") as (url, _):
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        request = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={"json": body,
                                                                                               "timeout": 60})
        request.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                values = vllm_values(httpx.get(url + "/metrics", timeout=60).text)
                if values["vllm:num_requests_running"] >= 1 or not request.is_alive() or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            usage = manager.usage
        finally:
            scraped.set()
            request.join()
    assert values["vllm:num_requests_running"] == 1 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == usage == 1 / 16


def test_vllm_metric_names(tiny, tokenizer):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_seqs=2)), tokenizer)
    with serving(engine, tokenizer, model_name="tiny", metrics_compat="vllm") as (url, _):
        httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3}, timeout=60)
        text = httpx.get(url + "/metrics").text
    values = vllm_values(text)
    assert set(values) == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0  # all done
    nano = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("nanoserve:kv_cache_usage_perc")}
    assert values["vllm:kv_cache_usage_perc"] == nano["nanoserve:kv_cache_usage_perc"]


def test_kv_events_refuse_a_learners_block_manager(tmp_path, monkeypatch):
    """Exercise 5.4 finished (the reference's code in a copy of exercises/): the learner's allocate_slots and
    _register_full_blocks change the prefix cache without telling the listeners, so recording is refused (serve
    prints it as one error: line) rather than publishing a stream that misses events."""
    import shutil

    from nanoserve import student
    from nanoserve.kv import block_manager as reference

    root = tmp_path / "exercises"
    shutil.copytree(student.EXERCISES, root, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(reference.__file__, root / student.STUDENT_FILES["nanoserve.kv.block_manager"])
    monkeypatch.setattr(student, "EXERCISES", root)
    learners = student.StudentCode("05").module("nanoserve.kv.block_manager").BlockManager(8, 4)
    with pytest.raises(ValueError, match="allocate_slots, _register_full_blocks"):
        record_kv_events(learners)
    assert record_kv_events(reference.BlockManager(8, 4)).take() == [AllBlocksCleared()]


def test_kv_events_refuse_a_learners_hash_that_names_blocks_otherwise(tmp_path, monkeypatch):
    """Exercise 5.2 finished with another cryptographic hash (SHA-512: a wider int, which meets 5.2's graded
    contract): the events' 32-byte hashes could not hold it, and a router recomputing the reference's chain would
    never match it, so recording is refused before the first request (serve prints it as one error: line). The
    reference's own hash, in the learner's file, is accepted."""
    import shutil

    from nanoserve import student
    from nanoserve.kv import block_manager, prefix_cache

    root = tmp_path / "exercises"
    shutil.copytree(student.EXERCISES, root, ignore=shutil.ignore_patterns("__pycache__"))
    learners_file = root / student.STUDENT_FILES["nanoserve.kv.prefix_cache"]
    monkeypatch.setattr(student, "EXERCISES", root)
    source = Path(prefix_cache.__file__).read_text()
    learners_file.write_text(source.replace("hashlib.sha256()", "hashlib.sha512()").replace(
        "parent_hash.to_bytes(32,", "parent_hash.to_bytes(64,"))
    learners = student.StudentCode("05").module("nanoserve.kv.prefix_cache").PrefixCache()
    assert learners.hash_block(None, [1, 2, 3]) >= 2**256  # wider than the wire's 32 bytes
    with pytest.raises(ValueError, match=r"your hash_block \(exercise 5\.2\) names blocks otherwise"):
        record_kv_events(block_manager.BlockManager(8, 4, prefix_cache=learners))
    learners_file.write_text(source)
    learners = student.StudentCode("05").module("nanoserve.kv.prefix_cache").PrefixCache()
    assert type(learners).__module__.startswith("student_")
    assert record_kv_events(block_manager.BlockManager(8, 4, prefix_cache=learners)).take() == [AllBlocksCleared()]


def test_kv_events_follow_blocks_loaded_from_a_kv_tier(tiny):
    """Chapter 18's tier: a returning prompt's blocks come back from the tier into the pool and are registered in the
    prefix cache by TieredBlockManager itself; those loads (and the evictions they make) are events too. Replaying
    the log gives the prefix cache's own entries. The tier starts out measured fast (the engine measures its own
    rates as it runs, so how many of the 40 returning blocks load depends on this machine): some load."""
    from nanoserve.engine.config import engine_config
    from nanoserve.kv.kv_events import BlockRemoved, BlockStored
    from tests.test_ch18_tier import serve, users

    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, kv_tier_blocks=64))
    try:
        log = record_kv_events(engine.block_manager)
        engine.block_manager.rates.loads.add(1 << 20, 1e-6)  # a megabyte a microsecond: loading pays at first
        engine.block_manager.rates.loads.add(2 << 20, 2e-6)
        serve(engine, users(tiny.config.vocab_size))
        assert engine.kv_tier_stats()["loaded_blocks"] > 0
        cached = {}
        for e in log.take()[1:]:
            if isinstance(e, BlockStored):
                assert e.block_hashes[0] not in cached
                cached[e.block_hashes[0]] = (e.parent_block_hash, e.token_ids)
            else:
                assert isinstance(e, BlockRemoved)
                del cached[e.block_hashes[0]]  # KeyError: a block removed that was never stored
        entries = engine.block_manager.prefix_cache.entries
        assert cached == {h: (p, list(t)) for h, p, t in entries.values()}
    finally:
        engine.close()
