"""Chapter 06 — parallel sampling (SamplingParams(n=N)) through fork and copy-on-write, on a tiny random model.

The oracle: completion i of a request with n > 1 and seed s is exactly what the same prompt with seed s + i
and n = 1 gets alone in a fresh engine. The block counts are worked out by hand (block_size 4)."""

import pytest
import torch

from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama

PROMPT = [5, 9, 2, 7, 11, 3, 8, 4, 6, 10]  # 10 tokens: blocks of 4 hold 4 + 4 + 2, the last one partial


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def params(n=1, seed=7, max_tokens=6):
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True, n=n)


def engine_for(model, **kw):
    return LLMEngine(model, engine_config(**{"num_blocks": 32, "block_size": 4, **kw}))


def run(engine, on_step=None):
    """Step until idle; {(request_id, index): final output}, and the tokens each step scheduled."""
    done, scheduled = {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        scheduled.append(engine.last_scheduler_output.total_num_scheduled_tokens)
        if on_step:
            on_step(engine)
        for out in outs:
            if out.finish_reason is not None:
                assert (out.request_id, out.index) not in done
                done[(out.request_id, out.index)] = out
    return done, scheduled


def assert_pool_whole(engine):
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
    assert engine.block_manager.block_tables == {} and engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_completion_is_its_seed_run_alone(tiny, prefix_caching):
    engine = engine_for(tiny, enable_prefix_caching=prefix_caching)
    engine.add_request("r", PROMPT, params(n=3))
    engine.add_request("other", [3, 1, 4, 1, 5, 9, 2, 6], params(seed=1))  # shares the batch
    done, scheduled = run(engine)
    assert_pool_whole(engine)
    completions = [done[("r", i)].token_ids for i in range(3)]
    for i in range(3):
        alone = engine_for(tiny)
        alone.add_request("a", PROMPT, params(seed=7 + i))
        assert completions[i] == run(alone)[0][("a", 0)].token_ids, f"completion {i}"
    assert len({tuple(c) for c in completions}) > 1  # the seeds differ, so (here) do the completions
    # only the request's very last output says finished; each completion ends with its own reason
    assert [done[("r", i)].finish_reason for i in range(3)] == ["length"] * 3
    assert sum(out.finished for key, out in done.items() if key[0] == "r") == 1


def test_prompt_computed_once_blocks_shared_then_copied(tiny):
    engine = engine_for(tiny, num_blocks=16)
    engine.add_request("r", PROMPT, params(n=3, max_tokens=4))
    engine.step()  # the prompt: 10 tokens, once; first tokens of all 3 completions sampled from its logits
    assert engine.last_scheduler_output.total_num_scheduled_tokens == 10
    bm = engine.block_manager
    tables = [bm.block_table(s) for s in ("r", "r#1", "r#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3  # forked: shared, nothing copied
    assert [bm.allocator.ref_count(b) for b in tables[0]] == [3, 3, 3]
    assert bm.get_num_free_blocks() == 16 - 3
    shared_last = tables[0][2]
    cache = engine.executor.workers[0].model_runner.kv_cache
    kv_before = [t[:, shared_last, :2].clone() for t in cache.k_cache + cache.v_cache]  # K of every layer, then V

    engine.step()  # each completion writes position 10 into the shared partial block: the first two copy it
    out = engine.last_scheduler_output
    assert out.total_num_scheduled_tokens == 3
    assert [src for src, _ in out.blocks_to_copy] == [shared_last, shared_last]
    copies = [dst for _, dst in out.blocks_to_copy]
    assert [bm.block_table(s)[2] for s in ("r", "r#1", "r#2")] == copies + [shared_last]  # the last writes in place
    assert [bm.allocator.ref_count(b) for b in tables[0][:2]] == [3, 3]  # full blocks stay shared
    assert bm.get_num_free_blocks() == 16 - 5
    for t, before in zip(cache.k_cache + cache.v_cache, kv_before):  # the copies hold the prompt's two tokens,
        for block in copies + [shared_last]:                         # K and V, as the original did
            torch.testing.assert_close(t[:, block, :2], before, rtol=0, atol=0)
    assert all(before.abs().sum() > 0 for before in kv_before)  # real K/V: an uncopied (zero) block would differ

    done, scheduled = run(engine)
    assert sum(scheduled) == 3 * 2  # 2 more decode steps of 3 completions: 4 tokens each, 10 + 3 * 3 in all
    assert_pool_whole(engine)


@pytest.mark.parametrize("when", ["prefilling", "forked"])
def test_abort_frees_every_completion(tiny, when):
    engine = engine_for(tiny, max_num_batched_tokens=4)  # the 10-token prompt takes 3 chunked steps
    engine.add_request("r", PROMPT, params(n=3))
    for _ in range(1 if when == "prefilling" else 4):
        engine.step()
    assert len(engine.scheduler.seqs) == (1 if when == "prefilling" else 3)
    out = engine.abort_request("r#2" if when == "forked" else "r")  # a completion's id names its request
    assert out.finished and out.finish_reason == "abort"
    assert_pool_whole(engine)
    assert engine.step() == [] and engine.abort_request("r") is None


def test_n_one_token_and_bad_n(tiny):
    engine = engine_for(tiny)
    engine.add_request("r", PROMPT, params(n=4, max_tokens=1))  # every completion ends at its first token
    done, scheduled = run(engine)
    assert sorted(i for _, i in done) == [0, 1, 2, 3] and scheduled == [10]
    assert_pool_whole(engine)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="max_num_seqs is 2"):
        engine_for(tiny, max_num_seqs=2).add_request("r", PROMPT, params(n=3))


def test_admission_reserves_the_seats_of_the_forks(tiny):
    """max_num_seqs=4: "a" (n=3) is admitted, "b" (n=2) would make 5 sequences once both fork, so it waits — and
    "c" (n=1) behind it too (the queue head is never overtaken) — until a's completions finish."""
    engine = engine_for(tiny, max_num_seqs=4)
    engine.add_request("a", PROMPT, params(n=3, max_tokens=3))
    engine.add_request("b", PROMPT[:6], params(n=2, max_tokens=2))
    engine.add_request("c", PROMPT[:4], params(max_tokens=2))
    plans = []

    def on_step(e):
        plans.append(e.last_scheduler_output.num_scheduled_tokens)
        assert len(e.scheduler.running) <= 4, [s.seq_id for s in e.scheduler.running]

    done, _ = run(engine, on_step)
    assert plans == [{"a": 10}, {"a": 1, "a#1": 1, "a#2": 1}, {"a": 1, "a#1": 1, "a#2": 1},
                     {"b": 2, "c": 4}, {"b": 1, "b#1": 1, "c": 1}]  # b's first block is a's, still cached
    assert sorted(done) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)]
    assert_pool_whole(engine)
