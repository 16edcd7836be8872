"""Chapter 04: the naive KV cache, checked against torch's own SDPA and against full recomputation.

Exercise 4.1 (write K/V and attend) is graded here; the generation tests check that the cached and
uncached loops of nanoserve/generate.py give the very same tokens.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from nanoserve.generate import generate
from nanoserve.kv.naive import NaiveKVCache
from nanoserve.model import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation

naive = implementation("nanoserve.kv.naive")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


def torch_attention(q, keys, values):
    """The oracle: torch's SDPA for N queries that are the last N of S positions. q (N, H, D), keys (S, Hkv, D)."""
    N, S = q.shape[0], keys.shape[0]
    allowed = torch.ones(N, S, dtype=torch.bool).tril(diagonal=S - N)  # query i sees keys 0 .. S-N+i
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=allowed, enable_gqa=True)
    return out.transpose(0, 1)  # (N, H, D)


def cached_logits(model, cache, token_ids, chunks):
    """Feed `token_ids` through the cache in forward passes of the given sizes; logits of every token."""
    logits, start = [], 0
    for size in chunks:
        ids = token_ids[start:start + size]
        logits.append(model.compute_logits(model(ids, cache.positions(size), cache)))
        cache.advance(size)
        start += size
    return torch.cat(logits)


# --- Exercise 4.1: the cache writes K/V and attends over everything cached --------------------

@pytest.mark.exercise("4.1")
def test_prefill_then_decode_matches_torch_attention_layer_by_layer():
    config = LlamaConfig.tiny(num_hidden_layers=2)
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cache = naive.NaiveKVCache(config, max_len=8)
    torch.manual_seed(1)
    q, k, v = torch.randn(8, H, D), torch.randn(8, Hkv, D), torch.randn(8, Hkv, D)
    for start, end in [(0, 5), (5, 6), (6, 8)]:  # a 5-token prefill, then 1 and 2 new tokens
        for layer in range(2):
            scale = layer + 1  # different K/V per layer: a cache that mixes layers up fails
            out = cache(layer, q[start:end], k[start:end] * scale, v[start:end] * scale)
            expected = torch_attention(q[start:end], k[:end] * scale, v[:end] * scale)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        cache.advance(end - start)


@pytest.mark.exercise("4.1")
def test_cache_stores_k_and_v_at_their_positions():
    config = LlamaConfig.tiny()
    cache = naive.NaiveKVCache(config, max_len=6)
    cache.kv.normal_(generator=torch.Generator().manual_seed(5))  # every position holds something to keep
    before = cache.kv.clone()
    cache.advance(2)  # pretend a 2-token prefill happened
    k, v = torch.randn(3, config.num_key_value_heads, config.head_dim), torch.randn(3, config.num_key_value_heads, config.head_dim)
    cache(1, torch.randn(3, config.num_attention_heads, config.head_dim), k, v)
    assert torch.equal(cache.kv[1, 0, 2:5], k) and torch.equal(cache.kv[1, 1, 2:5], v)
    # nothing else was touched: layer 0, and layer 1's positions 0..1 (cached) and 5 (free)
    written = torch.zeros_like(cache.kv, dtype=torch.bool)
    written[1, :, 2:5] = True
    assert torch.equal(cache.kv[~written], before[~written])
    assert cache.num_cached == 2  # the caller advances, once per forward pass


@pytest.mark.exercise("4.1")
def test_logits_prefill_and_decode_match_full_recompute_tiny(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = tiny.compute_logits(tiny(ids))
        cached = cached_logits(tiny, naive.NaiveKVCache(tiny.config, max_len=24), ids, [10] + [1] * 10 + [4])
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


@pytest.mark.exercise("4.1")
@settings(max_examples=15, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_any_split_into_forward_passes_gives_the_same_logits(tiny, chunks):
    # Prefill in pieces, decode, or both: the cache must not care how the tokens arrive.
    ids = torch.randint(0, tiny.config.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = tiny.compute_logits(tiny(ids))
        cached = cached_logits(tiny, naive.NaiveKVCache(tiny.config, max_len=sum(chunks)), ids, chunks)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


@pytest.mark.exercise("4.1")
@pytest.mark.slow
def test_logits_prefill_and_decode_match_full_recompute_smollm2(smollm2):
    ids = torch.randint(0, smollm2.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = smollm2.compute_logits(smollm2(ids))
        cached = cached_logits(smollm2, naive.NaiveKVCache(smollm2.config, max_len=64), ids, [32] + [1] * 8)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


@pytest.mark.exercise("4.1")
def test_overflow_names_both_lengths_before_writing():
    config = LlamaConfig.tiny()
    cache = naive.NaiveKVCache(config, max_len=4)
    cache.advance(3)
    before = cache.kv.clone()  # position 3 is free (zeros): a write that fits part of the tokens would show
    q, kv = torch.randn(2, config.num_attention_heads, config.head_dim), torch.randn(2, config.num_key_value_heads, config.head_dim)
    with pytest.raises(ValueError, match=r"(?s)5.*4|4.*5"):  # 3 cached + 2 new = 5 > max_len 4
        cache(0, q, kv, kv)
    assert torch.equal(cache.kv, before) and cache.num_cached == 3  # refused before anything is written


# --- The rest of the cache (given in the exercise) -------------------------------------------

def test_cache_bytes_follow_the_layout():
    config = LlamaConfig()  # SmolLM2: 30 layers, 3 kv heads, head_dim 64
    cache = NaiveKVCache(config, max_len=2048)
    assert cache.kv.shape == (30, 2, 2048, 3, 64)
    assert cache.nbytes == 30 * 2 * 2048 * 3 * 64 * 4 == 94_371_840


def test_max_len_beyond_context_names_both_lengths():
    with pytest.raises(ValueError, match=r"(?s)9000.*8192"):
        NaiveKVCache(LlamaConfig(), max_len=9000)


def test_advance_past_max_len_raises():
    cache = NaiveKVCache(LlamaConfig.tiny(), max_len=4)
    cache.advance(4)
    assert cache.positions(2).tolist() == [4, 5]
    with pytest.raises(ValueError, match="max_len 4"):
        cache.advance(1)


# --- Generation: the cached loop gives exactly the tokens of the uncached one ------------------

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_untied():
    # An untied head: with tied embeddings a random tiny model just repeats its last token.
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(tie_word_embeddings=False)).eval()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generate_with_cache_gives_the_same_tokens_tiny(tiny_untied, params):
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    without = generate(tiny_untied, prompt, params, eos_token_id=0)
    with_cache = generate(tiny_untied, prompt, params, eos_token_id=0, use_cache=True)
    assert len(set(without.token_ids)) >= 3  # a model that repeats one token would make a weak test
    assert with_cache.token_ids == without.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generate_with_cache_gives_the_same_tokens_smollm2(smollm2, hf_tokenizer, params):
    prompt = hf_tokenizer("The key-value cache of a transformer stores")["input_ids"]
    without = generate(smollm2, prompt, params, eos_token_id=hf_tokenizer.eos_token_id)
    with_cache = generate(smollm2, prompt, params, eos_token_id=hf_tokenizer.eos_token_id, use_cache=True)
    assert with_cache.token_ids == without.token_ids and len(with_cache.token_ids) == 16


def test_generate_with_cache_fills_the_context_exactly(tiny_untied):
    context = tiny_untied.config.max_position_embeddings  # 512
    prompt = list(range(1, 251)) * 2  # 500 tokens: 12 more fit
    out = generate(tiny_untied, prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                   eos_token_id=0, use_cache=True)
    assert len(out.token_ids) == context - len(prompt) and out.finish_reason == "length"


@pytest.mark.parametrize("use_cache", [False, True])
def test_prompt_longer_than_context_names_both_lengths(tiny_untied, use_cache):
    with pytest.raises(ValueError, match=r"(?s)600.*512"):
        generate(tiny_untied, [1] * 600, GREEDY, eos_token_id=0, use_cache=use_cache)


def test_the_benchmark_alternates_which_path_goes_first_even_with_one_round():
    """`bench kv-cache --rounds 1` must not always run the uncached path first: the order turns by context too."""
    from nanoserve.bench.kv_cache import path_order

    one_round = [path_order(context, 0) for context in range(4)]
    assert one_round == [(False, True), (True, False)] * 2
    assert [path_order(0, r) for r in range(3)] == [(False, True), (True, False), (False, True)]


def test_the_benchmarks_attention_timer_times_decode_steps_only(tiny):
    """The timer the benchmark hands the cache is chapter 01's attention itself, and it adds up decode calls only:
    a prefill of 5 tokens adds nothing, nor does a prefill of 1 token (one query, like a decode step's, but no
    cached keys: `--contexts 1`), and each one-token step after a prefill adds the time of one call per layer."""
    from nanoserve.bench.kv_cache import DecodeAttentionTimer
    from nanoserve.model.attention import scaled_dot_product_attention

    timer = DecodeAttentionTimer()
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(timer(q, k, k), scaled_dot_product_attention(q, k, k))
    assert timer.seconds == 0  # 5 queries: a prefill
    cache = NaiveKVCache(tiny.config, 8, attention=timer)
    ids = torch.arange(6)
    tiny(ids[:5], cache.positions(5), cache)
    cache.advance(5)
    assert timer.seconds == 0
    tiny(ids[5:], cache.positions(1), cache)
    assert timer.seconds > 0

    timer = DecodeAttentionTimer()
    cache = NaiveKVCache(tiny.config, 2, attention=timer)
    tiny(ids[:1], cache.positions(1), cache)  # a 1-token prompt's prefill
    cache.advance(1)
    assert timer.seconds == 0
    tiny(ids[1:2], cache.positions(1), cache)
    assert timer.seconds > 0
