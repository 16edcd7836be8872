"""Chapter 17: the KV connector between two engines (tiny model, both engines in this process, the real
shared-memory segments and ZMQ control channel between them)."""

import random
import time
from multiprocessing import shared_memory

import pytest
import torch

from nanoserve.engine.config import KVTransferConfig
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation
from tests.tiny_model import tiny_llama

BLOCK = 4


def staging(prefill: LLMEngine):
    """The producer's own StagingArea (its segments: never anyone else's /dev/shm files)."""
    return prefill.executor.workers[0].kv_connector.staging


def wait_for(condition, timeout: float = 30.0) -> bool:
    """Whether `condition` came within `timeout`: generous for a loaded machine, yet under the staging area's release
    timeout (kv_release_timeout_s, 60 s), so a segment released by that timeout still fails the wait."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=97)


def engine(model, role=None, **kw) -> LLMEngine:
    config = KVTransferConfig(role) if role else None
    return LLMEngine(model, engine_config(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=8,
                                         kv_transfer_config=config, **kw))


@pytest.fixture
def pair(model):
    prefill, decode = engine(model, "kv_producer"), engine(model, "kv_consumer")
    area = staging(prefill)
    yield prefill, decode
    prefill.close(), decode.close()
    assert not area.segments, "closing the producer frees every staged segment"
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in model.layers), \
        "closing an engine takes its connector's hooks off the model (which outlives it)"


def run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int, **kw):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), **kw)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.finished), last)
    return last


def prefill_then_decode(prefill, decode, request_id, prompt, max_tokens):
    staged = run(prefill, request_id, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    return staged, run(decode, request_id, prompt, max_tokens, kv_transfer_params=staged.kv_transfer_params)


# ---- the receiving side's plan, by hand (graded: exercise 17.1) ----------------------------------------------
def receive():
    return implementation("nanoserve.disagg.receive")


@pytest.mark.exercise("17.1")
@pytest.mark.parametrize("prompt, remote, computed, expected", [
    (10, 10, 0, 9),   # everything but the last prompt token, which samples the first output token
    (10, 10, 4, 5),   # a local prefix hit of one block skips it
    (10, 10, 8, 1),
    (10, 6, 8, 0),    # the remote holds less than the local hit
    (1, 1, 0, 0),     # a one-token prompt: nothing to receive
])
def test_num_tokens_to_receive_by_hand(prompt, remote, computed, expected):
    assert receive().num_tokens_to_receive(prompt, remote, computed) == expected


@pytest.mark.exercise("17.1")
def test_receive_slots_land_in_our_own_table():
    # table [7, 2, 5], block 4: positions 4..8 are block 2's slots 8..11, then block 5's first slot 20
    assert receive().receive_slots([7, 2, 5], 4, 5, 4) == [8, 9, 10, 11, 20]
    assert receive().receive_slots([3], 0, 3, 4) == [12, 13, 14]
    assert receive().receive_slots([3, 9], 6, 0, 4) == []
    with pytest.raises(ValueError):
        receive().receive_slots([3], 2, 3, 4)  # positions 2..4 need two blocks


# ---- the transfer against plain copies ----------------------------------------------------------------
def test_transferred_kv_is_the_producers_kv_at_our_slots(pair, model):
    """Every full block the decode engine received holds, in every layer, exactly what a colocated engine
    computed for the same positions. The requests are finished, but a prefix-cached pool keeps its blocks'
    contents under their chain hashes: the two pools are compared hash by hash, wherever each put them."""
    prefill, decode = pair
    prompt = [random.Random(1).randrange(97) for _ in range(14)]
    staged = run(prefill, "r", prompt, 1, kv_transfer_params={"do_remote_decode": True})
    assert staged.kv_transfer_params["remote_num_tokens"] == 14
    decode.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0),
                       kv_transfer_params=staged.kv_transfer_params)
    decode.step()
    loads = decode.last_scheduler_output.kv_connector_metadata.loads
    assert [(r.start, len(r.slots)) for r in loads] == [(0, 13)], "positions [0, 13) loaded; 13 computed here"
    assert decode.kv_connector.num_lost == 0 and not decode.has_unfinished_requests()
    plain = engine(model)
    run(plain, "r", prompt, 1)
    ours = decode.block_manager.prefix_cache.block_of_hash  # chain hash -> block id
    theirs = plain.block_manager.prefix_cache.block_of_hash
    assert len(ours) == (len(prompt) - 1) // BLOCK == 3, "blocks [0, 12) received (13 tokens: 3 full blocks)"
    assert set(ours) <= set(theirs)
    a, b = decode.executor.workers[0].model_runner.kv_cache, plain.executor.workers[0].model_runner.kv_cache
    for layer in range(model.config.num_hidden_layers):
        for h in ours:
            assert torch.equal(a.k_cache[layer][:, ours[h]], b.k_cache[layer][:, theirs[h]])
            assert torch.equal(a.v_cache[layer][:, ours[h]], b.v_cache[layer][:, theirs[h]])


def test_greedy_through_the_pair_is_the_colocated_engines(pair, model):
    prefill, decode = pair
    rng = random.Random(0)
    for i, length in enumerate([3, 8, 13, 21]):
        prompt = [rng.randrange(97) for _ in range(length)]
        staged, out = prefill_then_decode(prefill, decode, f"r{i}", prompt, 12)
        alone = run(engine(model), f"r{i}", prompt, 12)
        assert out.token_ids == alone.token_ids
        assert staged.token_ids == alone.token_ids[:1], "the prefill's one token is the same first token"
    assert wait_for(lambda: not staging(prefill).segments), "each segment is released once loaded"
    assert prefill.block_manager.get_num_free_blocks() == decode.block_manager.get_num_free_blocks() == 64


def test_a_decode_prefix_hit_skips_the_blocks_it_holds(pair):
    """A second request with the same 12-token prefix: the decode side loads only what follows its hit."""
    prefill, decode = pair
    shared = list(range(1, 13))
    prefill_then_decode(prefill, decode, "a", shared + [40, 41, 42], 2)
    decode.block_manager.stats.hit_tokens = 0
    staged = run(prefill, "b", shared + [50, 51, 52], 1, kv_transfer_params={"do_remote_decode": True})
    decode.add_request("b", shared + [50, 51, 52], SamplingParams(max_tokens=2, temperature=0),
                       kv_transfer_params=staged.kv_transfer_params)
    decode.step()
    loads = decode.last_scheduler_output.kv_connector_metadata.loads
    assert decode.block_manager.stats.hit_tokens == 12
    assert [(r.start, len(r.slots)) for r in loads] == [(12, 2)], "positions 12, 13 received; 14 computed here"


def test_aborts_anywhere_leave_no_block_and_no_segment(pair):
    """Requests aborted while waiting, mid-prefill, after staging and before the decode loaded: 0 blocks held on
    either side and every segment freed."""
    prefill, decode = pair
    rng = random.Random(2)
    for i in range(40):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(2, 30))]
        rid, where = f"r{i}", i % 4
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0),
                            kv_transfer_params={"do_remote_decode": True})
        if where == 0:  # before its first step
            prefill.abort_request(rid)
            continue
        staged = None
        while prefill.has_unfinished_requests():
            outs = prefill.step()
            if where == 1 and prefill.has_unfinished_requests():  # mid-prefill (a long prompt's first chunk)
                prefill.abort_request(rid)
            staged = next((o for o in outs if o.finished), staged)
        if staged is None or staged.kv_transfer_params is None:
            continue
        decode.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0),
                           kv_transfer_params=staged.kv_transfer_params)
        if where == 2:  # aborted while waiting: nothing loaded, the segment released by the consumer
            decode.abort_request(rid)
            continue
        decode.step()  # loaded; then aborted mid-decode
        decode.abort_request(rid)
    assert prefill.block_manager.get_num_free_blocks() == 64 and decode.block_manager.get_num_free_blocks() == 64
    assert not prefill.has_unfinished_requests() and not decode.has_unfinished_requests()
    assert wait_for(lambda: not staging(prefill).segments), f"segments left: {staging(prefill).segments}"


def test_a_full_decode_prefix_hit_releases_the_segment_it_will_not_load(pair):
    """The same 13-token prompt twice: the second time the decode engine's prefix cache holds [0, 12), all it
    would receive, so it loads nothing, and the segment is released at once (not left to the timeout)."""
    prefill, decode = pair
    prompt = list(range(5, 18))
    prefill_then_decode(prefill, decode, "a", prompt, 2)
    assert wait_for(lambda: not staging(prefill).segments)
    staged = run(prefill, "b", prompt, 1, kv_transfer_params={"do_remote_decode": True})
    assert len(staging(prefill).segments) == 1
    decode.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0),
                       kv_transfer_params=staged.kv_transfer_params)
    decode.step()
    assert decode.last_scheduler_output.kv_connector_metadata.loads == []
    assert wait_for(lambda: not staging(prefill).segments), "released, not left for the release timeout"


def test_a_transfer_that_cannot_load_fails_alone(pair, model):
    """A segment replaced, after the door, by one too small for its shape: the load fails inside the step,
    that request ends with an error, an ordinary request of the same step finishes, and the failed request's
    blocks are not left in the prefix cache for a later prompt to hit."""
    prefill, decode = pair
    bad, ok = list(range(20, 29)), [60, 61, 62, 63, 64]
    staged = run(prefill, "bad", bad, 1, kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    decode.add_request("bad", bad, SamplingParams(max_tokens=4, temperature=0), kv_transfer_params=staged)
    staging(prefill).release(staged["remote_segment"])
    small = shared_memory.SharedMemory(name=staged["remote_segment"], create=True, size=64)
    try:
        decode.add_request("ok", ok, SamplingParams(max_tokens=4, temperature=0))
        outs = decode.step()
        assert {o.request_id for o in decode.last_scheduler_output.scheduled_seqs} == {"bad", "ok"}
        failed = next(o for o in outs if o.request_id == "bad")
        assert failed.finished and "KVLoadError" in failed.error
        last = None
        while decode.has_unfinished_requests():
            last = next((o for o in decode.step() if o.finished), last)
        assert last.request_id == "ok" and last.error is None
        assert last.token_ids == run(engine(model), "ok", ok, 4).token_ids
    finally:
        small.close(), small.unlink()
    assert decode.block_manager.get_num_free_blocks() == 64
    assert run(decode, "again", bad, 4).token_ids == run(engine(model), "again", bad, 4).token_ids


def test_a_lost_segment_is_recomputed_not_failed(pair, model):
    """The producer freed the segment (timeout, restart) before the decode engine came: the prompt is computed
    on the decode side, the answer the same."""
    prefill, decode = pair
    prompt = list(range(3, 20))
    staged = run(prefill, "x", prompt, 1, kv_transfer_params={"do_remote_decode": True})
    prefill.executor.workers[0].kv_connector.staging.release(staged.kv_transfer_params["remote_segment"])
    out = run(decode, "x", prompt, 6, kv_transfer_params=staged.kv_transfer_params)
    assert out.token_ids == run(engine(model), "x", prompt, 6).token_ids
    assert decode.kv_connector.num_lost == 1


def test_bad_transfer_params_are_refused_at_the_door(pair, model):
    prefill, decode = pair
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="do_remote_decode"):
        prefill.add_request("a", [1, 2], params, kv_transfer_params={"remote_segment": "x"})
    with pytest.raises(ValueError, match="lacks"):
        decode.add_request("a", [1, 2], params, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="no KV connector"):
        engine(model).add_request("a", [1, 2], params, kv_transfer_params={"do_remote_decode": True})
    staged = run(prefill, "s", [1, 2, 3], 1, kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    with pytest.raises(ValueError, match="remote_shape"):
        decode.add_request("a", [1, 2], params, kv_transfer_params=staged | {"remote_shape": [1, 2, 3, 4, 5]})
    for key, value, match in [("remote_segment", "psm_secret", "remote_segment"),
                              ("remote_segment", "nskv_../../x", "remote_segment"),
                              ("remote_control", "tcp://10.0.0.7:5555", "remote_control"),
                              ("remote_control", "ipc:///tmp/anything", "remote_control"),
                              ("remote_shape", 5, "remote_shape")]:
        with pytest.raises(ValueError, match=f"^kv_transfer_params: {match}"):
            decode.add_request("a", [1, 2], params, kv_transfer_params=staged | {key: value})
    with pytest.raises(ValueError, match="^kv_transfer_params: .*prompt_logprobs"):
        decode.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1), kv_transfer_params=staged)
    small = shared_memory.SharedMemory(name="nskv_" + "0" * 20, create=True, size=64)
    try:  # a client naming a real segment too small for the shape it claims
        with pytest.raises(ValueError, match="^kv_transfer_params: segment .* holds 64 B"):
            decode.add_request("a", [1, 2, 3], params, kv_transfer_params=staged | {"remote_segment": small.name})
    finally:
        small.close(), small.unlink()
    decode.kv_connector.sender.release(staged["remote_control"], staged["remote_segment"])
    with pytest.raises(ValueError, match="speculative"):
        engine(model, "kv_consumer", speculative="ngram")

