"""Chapter 09's compiled step (nanoserve/model/compiled.py) against the eager model: the same hidden states on
a padded batch, the KV pool untouched by the padding rows (a plain-torch comparison of the pools), greedy
engine outputs equal on a tiny model, and on SmolLM2 q4 the float32 oracle's tokens except at near-ties.

One CompiledModel per module, with two small buckets, so the file compiles each graph once; the engine-level
checks reuse inductor's on-disk cache for the same graphs."""

import pytest
import torch

from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache
from nanoserve.model.compiled import CompiledModel, PaddedAttention
from tests.tiny_model import tiny_llama

BUCKETS = (4, 8)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def compiled(tiny):
    return CompiledModel(tiny, "buckets", BUCKETS)


def pool_for(model, num_blocks=6, block_size=4):
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    torch.manual_seed(1)
    for t in cache.k_cache + cache.v_cache:  # not zeros: a padding row writing zeros would show
        t.normal_()
    return cache


def step(model, cache, tables, seq_lens, query_lens, ids, positions):
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, cache.block_size)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.tensor(positions), PagedAttention(cache, meta))


def test_compiled_step_matches_eager_and_padding_writes_no_kv(tiny, compiled):
    """3 tokens padded to bucket 4, then 5 tokens padded to 8: the hidden states and every KV pool row equal
    the eager step's (close: inductor adds in another order), and the rows the step does not write are bit
    for bit what they were."""
    eager_pool, compiled_pool = pool_for(tiny), pool_for(tiny)
    before = [t.clone() for t in compiled_pool.k_cache + compiled_pool.v_cache]
    # A prefills positions 0-1 (block 0), B decodes position 4 (blocks 1, 2); then A 2-4 (block 3 too), B 5-6
    steps = [([[0], [1, 2]], [2, 5], [2, 1], [5, 9, 7], [0, 1, 4]),
             ([[0, 3], [1, 2]], [5, 7], [3, 2], [3, 2, 1, 8, 6], [2, 3, 4, 5, 6])]
    written = set()
    for tables, seq_lens, query_lens, ids, positions in steps:
        assert compiled.bucket(len(ids)) in BUCKETS and compiled.bucket(len(ids)) > len(ids)  # padding happens
        ref = step(tiny, eager_pool, tables, seq_lens, query_lens, ids, positions)
        got = step(compiled, compiled_pool, tables, seq_lens, query_lens, ids, positions)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        written |= set(AttentionMetadata.build(tables, seq_lens, query_lens, 4).slot_mapping.tolist())
    mask = torch.zeros(6 * 4, dtype=torch.bool)
    mask[list(written)] = True
    for old, new, ref in zip(before, compiled_pool.k_cache + compiled_pool.v_cache, eager_pool.k_cache + eager_pool.v_cache):
        flat_old, flat_new, flat_ref = (t.view(t.shape[0], -1, t.shape[-1]) for t in (old, new, ref))
        assert torch.equal(flat_new[:, ~mask], flat_old[:, ~mask])  # no padding row reached another slot
        torch.testing.assert_close(flat_new[:, mask], flat_ref[:, mask], rtol=1e-4, atol=1e-4)


def test_padded_attention_hands_over_only_the_real_rows():
    seen = []

    def attn(layer, q, k, v):
        seen.append((layer, q.shape[0], k.shape[0], v.shape[0]))
        return q + 1

    q, kv = torch.randn(8, 3, 2), torch.randn(8, 1, 2)
    out = PaddedAttention(attn, 5)(7, q, kv, kv)
    assert seen == [(7, 5, 5, 5)]
    assert torch.equal(out[:5], q[:5] + 1) and torch.equal(out[5:], torch.zeros(3, 3, 2))


def test_a_step_beyond_the_largest_bucket_runs_eagerly(tiny, compiled):
    assert compiled.bucket(9) is None and compiled.bucket(1) == 4 and compiled.bucket(8) == 8
    ids, positions = [(3 * j) % tiny.config.vocab_size for j in range(12)], list(range(12))
    ref = step(tiny, pool_for(tiny), [[0, 1, 2]], [12], [12], ids, positions)
    assert torch.equal(step(compiled, pool_for(tiny), [[0, 1, 2]], [12], [12], ids, positions), ref)  # the same ops
    with pytest.raises(ValueError, match="compile mode"):
        CompiledModel(tiny, "eager")


@pytest.mark.parametrize("mode", ["buckets", "dynamic"])
def test_engine_greedy_outputs_equal_eager_on_a_tiny_model(tiny, mode):
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling import SamplingParams

    prompts = [[(7 * i + j) % tiny.config.vocab_size for j in range(3 + 5 * i)] for i in range(3)]
    outs = {}
    for m in ("eager", mode):
        engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(kv_cache_memory=1 << 20), compile_mode=m))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        outs[m] = done
    assert outs[mode] == outs["eager"]  # a random tiny model has no near-ties at this scale
    with pytest.raises(ValueError, match="compile_mode"):
        LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(kv_cache_memory=1 << 20), compile_mode="fast"))


@pytest.mark.parametrize("flags, weights, kv, said", [
    ([], "q4", "bf16", "q4 weights, bf16 KV pool, eager step (--weights fp32 is the float32 reference)"),
    (["--compile-mode", "buckets"], "q4", "bf16", "q4 weights, bf16 KV pool, compiled step (buckets)"),
    (["--weights", "fp32"], "fp32", "auto", "fp32 weights, the model's KV pool, eager step"),
    (["--kv-cache-dtype", "fp32"], "q4", "fp32", "q4 weights, fp32 KV pool, eager step"),
    (["-tp", "3"], "fp32", "auto", "fp32 weights"),  # tensor parallelism runs float32
    (["--degrade-under-load", "8"], "fp32", "auto", "fp32 weights"),  # the q4 copy rides beside fp32
    (["--attention-backend", "triton"], "q4", "auto", "q4 weights, the model's KV pool"),
])
def test_serve_without_weights_serves_the_ggufs_own_format(flags, weights, kv, said):
    import argparse

    from nanoserve.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *flags])
    text = serve.serving_format(args)
    assert said in text
    assert (args.weights, args.kv_cache_dtype) == (weights, kv)
    from nanoserve.model.quant import LARGE_STEP_DTYPE  # chapter 10: q4's large steps, in the dtype they run in

    large = "large steps in " + ("bf16" if LARGE_STEP_DTYPE == torch.bfloat16 else "float32")
    assert (large in text) == (weights == "q4") and ("large steps" in text) == (weights == "q4")
