"""Chapter 05: paged attention equals contiguous attention.

Reference: per sequence, its whole K/V laid out contiguously and attention written out in the test
(repeat the K/V heads, scores, causal mask, softmax) — no block tables, no gathers, and not the fused
torch kernel the paged path calls. On the real model:
a batch of sequences stepping through PagedAttention gives the logits each sequence gets when run
alone, without any cache.
"""

import random

import pytest
import torch

from nanoserve.kv.block_manager import BlockManager, slot_mapping
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache, num_blocks_for_budget
from nanoserve.model.config import LlamaConfig


def reference_attention(q, k, v):
    """q (T, H, D), k/v (S, Hkv, D): the T queries are the last T of S positions, causal."""
    T, S = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (S, H, D): head h reads h // group
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5  # (H, T, S)
    allowed = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S): query t sits at S - T + t
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", weights, v)  # (T, H, D)


def random_batch(rng: random.Random, num_kv_heads: int, group: int, head_dim: int, block_size: int):
    """A mixed step: some sequences decode, some prefill a chunk on top of a cached prefix, some start fresh."""
    num_seqs = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 50) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, 1, s, rng.randint(1, s)]) for s in seq_lens]
    # non-contiguous block tables: blocks dealt from a shuffled pool with room to spare
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 7))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    H = num_kv_heads * group
    k_full = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    v_full = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    q = [torch.randn(n, H, head_dim) for n in query_lens]
    return seq_lens, query_lens, tables, len(pool) + sum(need), q, k_full, v_full


@pytest.mark.parametrize("seed", range(30))
def test_paged_equals_contiguous_on_random_batches(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv, G, D, bs = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([8, 16]), rng.choice([1, 4, 16])
    seq_lens, query_lens, tables, num_blocks, q, k_full, v_full = random_batch(rng, Hkv, G, D, bs)
    num_layers = 2
    cache = PagedKVCache(num_layers, num_blocks, bs, Hkv, D)
    layer = rng.randrange(num_layers)
    # the cached prefix of every sequence is already in the pool (written by earlier steps)
    for table, s, n, k, v in zip(tables, seq_lens, query_lens, k_full, v_full):
        cache.store_kv(layer, k[: s - n], v[: s - n], torch.tensor(slot_mapping(table, 0, s - n, bs), dtype=torch.long))

    meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)
    new_k = torch.cat([k[s - n:] for k, s, n in zip(k_full, seq_lens, query_lens)])
    new_v = torch.cat([v[s - n:] for v, s, n in zip(v_full, seq_lens, query_lens)])
    out = PagedAttention(cache, meta)(layer, torch.cat(q), new_k, new_v)
    looped = PagedAttention(cache, meta, batch_decodes=False)(layer, torch.cat(q), new_k, new_v)

    expected = torch.cat([reference_attention(qi, k, v) for qi, k, v in zip(q, k_full, v_full)])
    assert out.shape == expected.shape
    assert (out - expected).abs().max() < 1e-4
    assert (looped - expected).abs().max() < 1e-4
    # and this step's K/V landed in the pool at slot_mapping
    assert torch.equal(cache.k_cache[layer].view(Hkv, -1, D)[:, meta.slot_mapping].transpose(0, 1), new_k)


def test_metadata_build_worked_example():
    m = AttentionMetadata.build([[3], [0, 2]], seq_lens=[3, 6], query_lens=[3, 1], block_size=4)
    assert m.slot_mapping.tolist() == [12, 13, 14, 9]  # seq 0: positions 0..2 in block 3; seq 1: position 5 = block 2, offset 1
    assert m.block_tables.tolist() == [[3, 0], [0, 2]]
    assert m.seq_lens.tolist() == [3, 6] and m.cu_seqlens_q.tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([[0]], seq_lens=[2], query_lens=[3], block_size=4)


def test_copy_blocks_and_store_kv_shapes():
    cache = PagedKVCache(num_layers=2, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=4)
    k = torch.randn(2, 1, 4)
    cache.store_kv(1, k, -k, torch.tensor([2, 3]))  # both slots of block 1
    cache.copy_blocks([(1, 0)])
    assert torch.equal(cache.k_cache[1][:, 0], k.transpose(0, 1)) and torch.equal(cache.v_cache[1][:, 0], -k.transpose(0, 1))
    assert cache.nbytes == 2 * 2 * 3 * 2 * 1 * 4 * 4
    with pytest.raises(ValueError, match="num_tokens"):
        cache.store_kv(0, k, k, torch.tensor([0]))


def test_pool_size_from_a_memory_budget():
    config = LlamaConfig()  # SmolLM2: 46,080 B of K/V per token in float32, 737,280 B per 16-token block
    assert num_blocks_for_budget(config, 2**30, block_size=16) == 1456  # floor(1073741824 / 737280)
    assert num_blocks_for_budget(config, 2**30, block_size=16, dtype=torch.bfloat16) == 2912
    cache = PagedKVCache.for_model(LlamaConfig.tiny(), budget_bytes=10**6, block_size=16)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    assert cache.num_blocks == 10**6 // per_block
    assert cache.k_cache[0].shape == (2, cache.num_blocks, 16, 16)  # (Hkv, blocks, block_size, D)


@pytest.mark.slow
@torch.inference_mode()
def test_batched_paged_steps_match_each_sequence_alone(smollm2):
    """Three engine-like steps of a mixed batch on the real model, block size 4 and a shuffled pool;
    the last request shares a cached prefix. Each step's logits == the sequence run alone, no cache."""
    config = smollm2.config
    bs = 4
    manager = BlockManager(num_blocks=64, block_size=bs)
    manager.allocate_slots(99, list(range(1000, 1040)), 40)  # scatter the free list: later tables are not contiguous
    manager.free(99)
    cache = PagedKVCache(config.num_hidden_layers, 64, bs, config.num_key_value_heads, config.head_dim)
    g = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for s, n in [(0, 13), (1, 22), (2, 6)]}
    prompts[3] = prompts[1][:17] + [5, 6, 7]  # shares 4 full blocks with sequence 1

    streams = {s: p + [11 * s + 1, 11 * s + 2] for s, p in prompts.items()}  # prompt, then "sampled" tokens
    computed = {}
    steps = [  # seq_id -> the position this step computes up to
        {0: 13, 1: 10, 2: 6},  # 0 and 2 prefill whole prompts, 1 its first chunk
        {0: 14, 1: 22, 2: 7},  # decodes next to the rest of 1's prompt, on top of its cached chunk
        {0: 15, 1: 23, 2: 8, 3: 20},  # 3 arrives: its first 16 tokens are cache hits, 4 are computed
    ]
    for step, schedule in enumerate(steps):
        ids, positions, seq_lens, query_lens = [], [], [], []
        for seq_id, end in schedule.items():
            start = computed.get(seq_id, manager.lookup_prefix(prompts[seq_id]))
            assert manager.allocate_slots(seq_id, streams[seq_id][:end], end) is not None
            ids += streams[seq_id][start:end]
            positions += range(start, end)
            seq_lens.append(end)
            query_lens.append(end - start)
            computed[seq_id] = end
        meta = AttentionMetadata.build([manager.block_table(s) for s in schedule], seq_lens, query_lens, bs)
        logits = smollm2.compute_logits(smollm2(torch.tensor(ids), torch.tensor(positions), PagedAttention(cache, meta)))
        for i, (seq_id, end) in enumerate(schedule.items()):
            alone = smollm2.compute_logits(smollm2(torch.tensor(streams[seq_id][:end])))[end - query_lens[i]:]
            got = logits[meta.cu_seqlens_q[i]: meta.cu_seqlens_q[i + 1]]
            assert (got - alone).abs().max() < 1e-3, f"step {step}, sequence {seq_id}"
    assert query_lens[-1] == 4 and manager.stats.hit_tokens == 16
    assert manager.block_table(3)[:4] == manager.block_table(1)[:4]
