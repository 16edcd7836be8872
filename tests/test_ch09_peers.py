"""Chapter 09 — `bench peers`' single stream: its prefill figure times the whole prompt every round, never a
prefix-cache hit on the previous round's blocks (the prompt is the same each round)."""

from types import SimpleNamespace

from nanoserve.bench.peers import single_stream
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from tests.tiny_model import tiny_llama


def test_every_rounds_prefill_computes_the_whole_prompt():
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64, block_size=16), eos_token_id=-1)
    assert engine.config.cache_config.enable_prefix_caching  # the default: what could hit
    tokenizer = SimpleNamespace(encode=lambda text: [ord(c) % 256 for c in text])  # the tiny model's 256 ids
    stats = engine.block_manager.stats
    for _ in range(2):
        before = stats.hit_tokens
        decode, prefill = single_stream(SimpleNamespace(engine=engine), 96, 4, tokenizer)
        assert decode > 0 and prefill > 0
    # the second round's prefill found nothing of the first's 96 tokens; only the decode's 32-token prompt,
    # the same every round, hits: its first block of 16 (the block holding the last prompt token is computed)
    assert stats.hit_tokens - before == 16
    assert not engine.has_unfinished_requests()


def test_rounds_alternate_the_order_of_the_systems():
    from nanoserve.bench.peers import alternate

    names = ["nanoserve q4", "nanoserve q4, torch kernels", "llama.cpp llama-bench"]
    assert [alternate(names, r) for r in range(3)] == [names, names[::-1], names]


def test_every_multi_request_round_computes_every_prompt():
    """The warm-up, each round and a larger --num-requests (whose prompts begin with the smaller's) serve the same
    prompts: no call may find another's blocks in the prefix cache (transformers computes every prompt)."""
    from nanoserve.bench.peers import nanoserve_job, text_requests

    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64, block_size=16), eos_token_id=-1)
    tokenizer = SimpleNamespace(encode=lambda text: [ord(c) % 256 for c in text])
    small, large = text_requests(tokenizer, 2, (40, 60)), text_requests(tokenizer, 3, (40, 60))
    assert large[:2] == small  # the same seed: the larger set begins with the smaller
    stats, llm = engine.block_manager.stats, SimpleNamespace(engine=engine)
    jobs = [nanoserve_job(llm, small, 4)] * 3 + [nanoserve_job(llm, large, 4)] * 2  # warm-up + 2 rounds, then 3
    for job in jobs:
        assert job() > 0
    assert stats.hit_tokens == 0
    assert stats.queried_tokens == 3 * sum(map(len, small)) + 2 * sum(map(len, large))
