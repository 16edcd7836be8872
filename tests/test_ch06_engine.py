"""Chapter 06 — the engine on the real model: continuous batching must not change what a request gets.

The oracle for greedy decoding is the request run *alone* (one request in the engine), itself checked
against the plain no-cache forward pass of chapter 02 (every token recomputed from scratch).
Every engine test ends with the pool whole: get_num_free_blocks() == num_blocks (no block leaks).
"""

import random

import pytest
import torch

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The river wound slowly through the valley, past farms and orchards and the old stone mill that had "
    "stood there for three hundred years. Every spring the water rose and covered the low fields, and every "
    "summer the children of the village swam in the deep pool below the bridge. In the autumn the farmers "
    "brought their apples to the market in the square, where merchants from the city came to buy cider, "
    "cheese and wool. The baker opened his shop before dawn, and the smell of fresh bread drifted down the "
    "narrow streets while the church bell rang six times. Python is a programming language that lets you work "
    "quickly and integrate systems more effectively. A list is an ordered collection of items, and a "
    "dictionary maps keys to values. To read a file, open it with a context manager and iterate over its lines."
)


def assert_pool_whole(engine):
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def workload():
    """32 greedy requests: prompts of 5–60 tokens cut from real text, 8–24 new tokens each."""
    from nanoserve.text.tokenizer import Tokenizer

    return cut_requests(Tokenizer.from_gguf().encode(TEXT), 32, (5, 60), (8, 24))


def cut_requests(ids: list[int], count: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int],
                 seed: int = 0) -> list[tuple[list[int], int]]:
    """`count` (prompt, max_tokens) pairs: prompts of prompt_lens[0]..[1] tokens cut at random places from
    `ids`, each with new_tokens[0]..[1] new tokens (bounds included; seeded, so every run gets the same)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        n = rng.randint(*prompt_lens)
        start = rng.randint(0, len(ids) - n)
        requests.append((ids[start:start + n], rng.randint(*new_tokens)))
    return requests


def run(engine, requests, params=None, on_step=None):
    """Submit everything at once; step until idle, calling on_step(scheduler_output) after each step.
    Returns {request index: generated ids}."""
    for i, (prompt, max_tokens) in enumerate(requests):
        p = params[i] if params else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(i), prompt, p)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.token_ids
        if on_step:
            on_step(engine.last_scheduler_output)
    assert_pool_whole(engine)
    return results


@pytest.fixture(scope="module")
def alone(smollm2, workload):
    """Each request on its own, one after another through one engine."""
    engine = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64)))
    return {i: run(engine, [req])[0] for i, req in enumerate(workload)}


@torch.inference_mode()
def test_alone_matches_the_no_cache_forward_pass(smollm2, workload, alone):
    for i in (0, 1, 2):  # a few: each no-cache step reruns the whole sequence
        ids, (prompt, max_tokens) = [], workload[i]
        for _ in range(max_tokens):
            logits = smollm2.compute_logits(smollm2(torch.tensor(prompt + ids))[-1:])
            ids.append(int(logits.argmax(-1)))
        assert alone[i] == ids


@pytest.mark.parametrize("chunked, budget", [(True, 64), (False, 256)], ids=["chunked-prefill", "whole-prefill"])
def test_batch_invariance(smollm2, workload, alone, chunked, budget):
    engine = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=256),
                                             scheduler_config=SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked)))
    counts = {"chunks": 0, "mixed steps": 0}

    def on_step(so):
        # (called after the step: a partial chunk leaves part of the prompt uncomputed, a decode computed past it)
        counts["chunks"] += sum(s.num_computed_tokens < s.num_prompt_tokens for s in so.scheduled_seqs)
        counts["mixed steps"] += len({s.num_computed_tokens > s.num_prompt_tokens for s in so.scheduled_seqs}) == 2

    assert run(engine, workload, on_step=on_step) == alone
    assert counts["mixed steps"] > 0  # some step ran decodes and prefills together
    assert (counts["chunks"] > 0) == chunked


def test_preemption_under_a_tiny_pool_changes_nothing(smollm2, workload, alone):
    # the longest request needs ceil((60 + 24) / 16) = 6 blocks; 12 blocks hold two of them
    engine = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=12, block_size=16),
                                             scheduler_config=SchedulerConfig(max_num_batched_tokens=128)))
    preempted = []
    assert run(engine, workload, on_step=lambda so: preempted.extend(so.preempted_seq_ids)) == alone
    assert preempted, "the pool was meant to be too small: no preemption happened"


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2, workload):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=m, ignore_eos=True)
              for i, (_, m) in enumerate(workload[:8])]
    together = run(LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64))), workload[:8], params)
    engine = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64)))
    for i in (0, 5):
        assert run(engine, [workload[i]], [params[i]])[0] == together[i]


def test_a_prefix_computed_in_the_same_step_is_shared_and_changes_nothing(smollm2):
    """Two prompts with a 20-token common prefix arrive together: the first one's blocks are registered when the
    step allocates them and written, layer by layer, before anyone attends in that layer, so the second request,
    scheduled in the same first step, computes only its own 3 tokens (chapter 05, section 5). Its tokens are those
    of the same two requests with prefix caching off."""
    from nanoserve.text.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf().encode(TEXT)
    requests = [(ids[:22], 8), (ids[:20] + ids[40:43], 8)]  # the common prefix: 5 full blocks of 4
    shared = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=4)))
    first_steps = []
    got = run(shared, requests, on_step=lambda so: first_steps.append(dict(so.num_scheduled_tokens)))
    assert first_steps[0] == {"0": 22, "1": 3}  # both in step 1; the second hit the first one's 20 tokens
    off = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=4,
                                                                   enable_prefix_caching=False)))
    assert got == run(off, requests)


def test_prefix_cache_hit_skips_tokens_and_changes_nothing(smollm2, workload, alone):
    engine = LLMEngine(smollm2, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=4)))
    prompt, max_tokens = workload[3]
    first = run(engine, [workload[3]])[0]
    engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    engine.step()
    cached = (len(prompt) - 1) // 4 * 4  # every full block but never the last token
    assert engine.last_scheduler_output.num_scheduled_tokens["again"] == len(prompt) - cached
    while engine.has_unfinished_requests():
        out = engine.step()
    assert first == alone[3] == out[0].token_ids
    assert_pool_whole(engine)
