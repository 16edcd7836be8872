"""Chapter 14 — speculative decoding on the real model: greedy outputs token-identical to plain decoding.

Real prompts from the course set's "grounded" kind (the answer copies its input, so n-gram proposals are
accepted and rejected both) and open chat, alone and all in one batch, with the n-gram proposer; the draft
(the model's first layers) on one of them. The oracle is the same engine without speculation.
"""

import pytest

from nanoserve.bench.prompts import course_prompts
from nanoserve.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams

pytestmark = pytest.mark.slow


def run(engine, prompts, max_tokens=24):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    out = {}
    while engine.has_unfinished_requests():
        out.update({int(o.request_id): o.token_ids for o in engine.step() if o.finished})
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    items = course_prompts(3, seed=0, kinds=["grounded"]) + course_prompts(1, seed=0, kinds=["chat"])
    return [smollm2_tokenizer.encode_chat(p["messages"]) for p in items]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    return run(LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=128))), prompts)


def test_ngram_greedy_parity_alone_and_batched(smollm2, prompts, plain):
    config = EngineConfig(cache_config=CacheConfig(num_blocks=128),
                          speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=None))
    engine = LLMEngine(smollm2, config)
    assert [run(engine, [ids])[0] for ids in prompts[:2]] == plain[:2]
    assert run(engine, prompts) == plain
    s = engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # proposals kept and rolled back, outputs unchanged


def test_draft_greedy_parity(smollm2, prompts, plain):
    config = EngineConfig(cache_config=CacheConfig(num_blocks=128),
                          speculative_config=SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_num_layers=4))
    engine = LLMEngine(smollm2, config)
    assert run(engine, prompts[:1], max_tokens=8) == [plain[0][:8]]
    s = engine.spec_stats  # an untrained early exit: proposals made, and some rejected and rolled back
    assert s.num_draft_tokens > 0 and s.num_rejections > 0 and s.num_accepted_tokens < s.num_draft_tokens
