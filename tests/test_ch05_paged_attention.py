"""Chapter 05: paged attention equals contiguous attention (exercises 5.5 and 5.6, graded).

Reference: per sequence, its whole K/V laid out contiguously and attention written out in the test
(repeat the K/V heads, scores, causal mask, softmax) — no block tables, no gathers, and not the fused
torch kernel the paged path calls. The pools are filled with finite garbage first, so a gather that reads a
wrong slot, or padding that is not masked, changes the answer. Graded: 5.5 the dense gather of one
sequence (the checkpoint), one sequence's attention through its block table, and PagedAttention's whole
step (small mixed steps, and steps with more decodes than one group); 5.6 the batched decode gather with its padding mask (DecodeGroup). On the real model: a batch of
sequences stepping through PagedAttention gives the logits each sequence gets when run alone, without any cache.
"""

import random

import pytest
import torch

from nanoserve.kv.block_manager import BlockManager
from nanoserve.kv.paged_attention import (DECODE_GROUP, AttentionMetadata, PagedAttention, PagedKVCache,
                                          num_blocks_for_budget)
from nanoserve.model.attention import causal_mask
from nanoserve.model.config import LlamaConfig
from nanoserve.student import implementation


@pytest.fixture
def pa():
    """The paged_attention module under test (the learner's, under `make grade`)."""
    return implementation("nanoserve.kv.paged_attention")


def slots(table, start, end, bs):
    """Positions [start, end) -> pool slots (the test's own slot mapping)."""
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)


def garbage_pool(num_layers, num_blocks, bs, Hkv, D, dtype=torch.float32):
    """A pool whose every slot holds finite garbage, until a test writes a sequence's K/V into it."""
    cache = PagedKVCache(num_layers, num_blocks, bs, Hkv, D, dtype)
    for t in cache.k_cache + cache.v_cache:
        t.copy_(10 * torch.randn_like(t))
    return cache


def write(cache, layer, table, k, v):
    """Put a sequence's k, v (S, Hkv, D) at positions [0, S) of its block table, slot by slot (not store_kv)."""
    bs = cache.block_size
    for p in range(k.shape[0]):
        cache.k_cache[layer][:, table[p // bs], p % bs] = k[p]
        cache.v_cache[layer][:, table[p // bs], p % bs] = v[p]


def reference_attention(q, k, v):
    """q (T, H, D), k/v (S, Hkv, D): the T queries are the last T of S positions, causal."""
    T, S = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (S, H, D): head h reads h // group
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5  # (H, T, S)
    allowed = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S): query t sits at S - T + t
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", weights, v)  # (T, H, D)


def random_batch(rng: random.Random, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                 decodes_only: bool = False, more_decodes: int = 0):
    """A mixed step: some sequences decode, some prefill a chunk on top of a cached prefix, some start fresh;
    then `more_decodes` further sequences that decode, their contexts as mixed as the others'."""
    num_seqs = rng.randint(1, 6) if not decodes_only else rng.randint(1, 10)
    seq_lens = [rng.randint(1, 50) for _ in range(num_seqs + more_decodes)]
    query_lens = [1 if decodes_only or i >= num_seqs else rng.choice([1, 1, s, rng.randint(1, s)])
                  for i, s in enumerate(seq_lens)]
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


@pytest.mark.exercise("5.5")
def test_gather_kv_is_the_sequence_dense_and_in_order(pa):
    """The checkpoint: one sequence's K (or V) out of a garbage-filled pool, through a scattered table."""
    torch.manual_seed(0)
    Hkv, D, bs = 2, 3, 4
    cache = garbage_pool(1, 9, bs, Hkv, D)
    table = [6, 2, 8]  # positions 0..3 in block 6, 4..7 in block 2, 8..9 in block 8
    k, v = torch.randn(10, Hkv, D), torch.randn(10, Hkv, D)
    write(cache, 0, table, k, v)
    got = pa.gather_kv(cache.k_cache[0], torch.tensor(table), 10)
    assert got.shape == (Hkv, 10, D)  # heads first, the tail of block 8 cut off
    assert torch.equal(got, k.transpose(0, 1))
    assert torch.equal(pa.gather_kv(cache.v_cache[0], torch.tensor(table), 10), v.transpose(0, 1))
    assert torch.equal(pa.gather_kv(cache.k_cache[0], torch.tensor(table), 5), k[:5].transpose(0, 1))  # a longer table


@pytest.mark.exercise("5.5")
@pytest.mark.parametrize("prefix", [0, 5, 9])  # a whole prompt (no mask), chunks on top of a cached prefix
def test_attend_sequence_through_its_block_table(pa, prefix):
    torch.manual_seed(prefix)
    Hkv, G, D, bs, S = 2, 3, 8, 4, 14
    cache = garbage_pool(2, 8, bs, Hkv, D)
    table = [5, 0, 7, 2]
    k, v = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
    write(cache, 1, table, k, v)
    q = torch.randn(S - prefix, Hkv * G, D)
    mask = None if prefix == 0 else causal_mask(S - prefix, S)
    out = pa.attend_sequence(q, cache.k_cache[1], cache.v_cache[1], torch.tensor(table), S, mask)
    assert out.shape == q.shape
    assert (out - reference_attention(q, k, v)).abs().max() < 1e-4


# The pool's dtype and the tolerance against the float32 reference: serve's default pool is bf16, under a model
# whose q, k, v are float32, so the step stores and attends in bf16 (8 bits of mantissa: outputs of size ~1 are
# off by up to ~1e-2).
POOLS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def check_a_step(pa, seed: int, dtype: torch.dtype, more_decodes: int = 0):
    """A whole step of PagedAttention on a random batch (random_batch), every sequence one at a time
    (batch_decodes=False), then with the decodes batched (exercise 5.6's DecodeGroup, the reference's while 5.5
    is graded), against the reference on each sequence's contiguous K/V; and this step's K/V at their slots. On a bf16 pool float32 q, k, v are stored and attended in bf16 and
    the output comes back in float32; the reference attends the bf16-rounded q, k, v in float32."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv, G, D, bs = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([8, 16]), rng.choice([1, 4, 16])
    seq_lens, query_lens, tables, num_blocks, q, k_full, v_full = random_batch(rng, Hkv, G, D, bs,
                                                                               more_decodes=more_decodes)
    num_layers = 2
    cache = garbage_pool(num_layers, num_blocks, bs, Hkv, D, dtype)
    layer = rng.randrange(num_layers)
    # the cached prefix of every sequence is already in the pool (written by earlier steps)
    for table, s, n, k, v in zip(tables, seq_lens, query_lens, k_full, v_full):
        write(cache, layer, table, k[: s - n], v[: s - n])

    meta = pa.AttentionMetadata.build(tables, seq_lens, query_lens, bs)
    new_k = torch.cat([k[s - n:] for k, s, n in zip(k_full, seq_lens, query_lens)])
    new_v = torch.cat([v[s - n:] for v, s, n in zip(v_full, seq_lens, query_lens)])
    looped = pa.PagedAttention(cache, meta, batch_decodes=False)(layer, torch.cat(q), new_k, new_v)
    out = pa.PagedAttention(cache, meta)(layer, torch.cat(q), new_k, new_v)

    rounded = [[t.to(dtype).float() for t in seq] for seq in zip(q, k_full, v_full)]  # what the pool holds
    expected = torch.cat([reference_attention(qi, k, v) for qi, k, v in rounded])
    assert looped.shape == out.shape == expected.shape
    assert looped.dtype == out.dtype == torch.float32  # the model's dtype, whatever the pool's
    assert (looped - expected).abs().max() < POOLS[dtype]
    assert (out - expected).abs().max() < POOLS[dtype]
    # and this step's K/V landed in the pool at their slots
    new_slots = torch.cat([slots(t, s - n, s, bs) for t, s, n in zip(tables, seq_lens, query_lens)])
    assert torch.equal(cache.k_cache[layer].view(Hkv, -1, D)[:, new_slots].transpose(0, 1), new_k.to(dtype))
    assert torch.equal(cache.v_cache[layer].view(Hkv, -1, D)[:, new_slots].transpose(0, 1), new_v.to(dtype))
    return query_lens


@pytest.mark.exercise("5.5")
@pytest.mark.parametrize("seed, dtype", [(seed, torch.float32) for seed in range(30)]
                         + [(seed, torch.bfloat16) for seed in range(6)], ids=str)
def test_paged_equals_contiguous_on_random_batches(pa, seed, dtype):
    """Mixed steps of up to 6 sequences: decodes, chunks on a cached prefix, whole prompts (check_a_step)."""
    check_a_step(pa, seed, dtype)


@pytest.mark.exercise("5.5")
@pytest.mark.parametrize("seed", range(4))
def test_paged_equals_contiguous_with_several_decode_groups(pa, seed):
    """A step of 10 to 26 decodes with contexts of 1 to 50 tokens (more than DECODE_GROUP, so two to four
    groups), beside a mixed step's chunks and prompts: every group's rows are answered, not only the first's."""
    query_lens = check_a_step(pa, 100 + seed, torch.float32, more_decodes=random.Random(seed).randint(10, 20))
    assert query_lens.count(1) > DECODE_GROUP  # the step does reach a second group


@pytest.mark.exercise("5.6")
@pytest.mark.parametrize("seed, dtype", [(seed, torch.float32) for seed in range(12)]
                         + [(seed, torch.bfloat16) for seed in range(3)], ids=str)
def test_a_decode_group_equals_contiguous_attention(pa, seed, dtype):
    """Decodes of very different lengths in one padded gather, in every layer: the padding (garbage in the pool,
    and block 0 in the padded tables, which belongs to someone) must get no weight. On a bf16 pool the queries
    come in bf16 (PagedAttention converts them), and so are the group's gather buffers."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv, G, D, bs = rng.choice([1, 2]), rng.choice([1, 3]), 8, rng.choice([1, 4, 16])
    seq_lens, query_lens, tables, num_blocks, q, k_full, v_full = random_batch(rng, Hkv, G, D, bs, decodes_only=True)
    q, k_full, v_full = ([t.to(dtype).float() for t in ts] for ts in (q, k_full, v_full))  # what the pool holds
    cache = garbage_pool(2, num_blocks, bs, Hkv, D, dtype)
    for layer in range(2):  # the new token's K/V are in the pool already (PagedAttention stores them first)
        for table, k, v in zip(tables, k_full, v_full):
            write(cache, layer, table, (-1) ** layer * k, v)
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)
    seqs = rng.sample(range(len(seq_lens)), rng.randint(1, len(seq_lens)))  # any subset, in any order
    group = pa.DecodeGroup(cache, meta, seqs)
    assert group.tokens.tolist() == seqs  # one query each: sequence i's query is row i of the flat batch
    q_group = torch.cat(q)[seqs].to(dtype)  # (Sd, H, D)
    for layer in range(2):  # built once, used by every layer
        out = group.attend(q_group, cache.k_cache[layer], cache.v_cache[layer])
        expected = torch.cat([reference_attention(q[i], (-1) ** layer * k_full[i], v_full[i]) for i in seqs])
        assert out.shape == expected.shape
        assert (out.float() - expected).abs().max() < POOLS[dtype], f"layer {layer}"


@pytest.mark.exercise("5.6")
def test_a_decode_group_finds_its_rows_among_prefills(pa):
    """Decodes between prefill chunks in the flat batch: a decode's query row is its cu_seqlens_q entry."""
    torch.manual_seed(1)
    Hkv, D, bs = 1, 4, 2
    cache = garbage_pool(1, 10, bs, Hkv, D)
    tables, seq_lens, query_lens = [[3, 4], [1], [5, 6, 7]], [4, 2, 5], [1, 2, 1]  # decode, prefill, decode
    k_full = [torch.randn(s, Hkv, D) for s in seq_lens]
    for table, k in zip(tables, k_full):
        write(cache, 0, table, k, k)
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)  # cu_seqlens_q [0, 1, 3, 4]
    group = pa.DecodeGroup(cache, meta, [2, 0])
    assert group.tokens.tolist() == [3, 0]
    q = torch.randn(2, 2, D)  # 2 query heads on 1 kv head
    out = group.attend(q, cache.k_cache[0], cache.v_cache[0])
    for row, i in enumerate([2, 0]):
        assert (out[row] - reference_attention(q[row:row + 1], k_full[i], k_full[i])[0]).abs().max() < 1e-4


def test_a_step_plans_its_masks_on_the_pool_device():
    """A pool on another device than the CPU (a GPU's, here "meta", which checks devices as strictly and needs
    none): the causal mask of a chunk on a cached prefix must be made on the pool's device, or the attention call
    mixes devices and fails. The step's plan (cu_seqlens_q, seq_lens, block tables) stays on the host, as it may."""
    bs, Hkv, G, D = 4, 2, 3, 8
    cache = PagedKVCache(1, 8, bs, Hkv, D, torch.bfloat16, "meta")
    host = AttentionMetadata.build([[5, 0, 7], [2]], [10, 3], [4, 3], bs)  # a 4-token chunk on 6 cached; a prompt
    meta = AttentionMetadata(host.slot_mapping.to("meta"), host.block_tables, host.seq_lens, host.cu_seqlens_q)
    q, k, v = torch.empty(7, Hkv * G, D, device="meta"), *(torch.empty(7, Hkv, D, device="meta") for _ in range(2))
    out = PagedAttention(cache, meta)(0, q, k, v)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype


def test_a_step_on_another_device_takes_the_engines_host_metadata():
    """The engine's model runner builds the step's metadata on the host (AttentionMetadata.build) whatever the
    pool's device: on a GPU's pool (here "meta", as strict about devices) the step copies what the pool's device
    reads (slots, block tables, the decodes' tiles and padding mask) there itself, decodes, a chunk and a prompt."""
    bs, Hkv, G, D = 4, 2, 3, 8
    cache = PagedKVCache(1, 8, bs, Hkv, D, torch.float32, "meta")
    host = AttentionMetadata.build([[5, 0, 7], [2], [1, 3], [4]], [10, 3, 6, 2], [4, 3, 1, 1], bs)
    q, k, v = torch.empty(9, Hkv * G, D, device="meta"), *(torch.empty(9, Hkv, D, device="meta") for _ in range(2))
    attn = PagedAttention(cache, host)
    out = attn(0, q, k, v)
    assert out.device.type == "meta" and out.shape == q.shape
    assert len(attn.decode_groups) == 1 and attn.decode_groups[0].tiles.device.type == "meta"


def test_rope_tables_are_made_on_the_positions_device():
    """A model on a GPU gets its positions there (the runner puts them on the pool's device): the RoPE tables
    must be made there too, a CPU table of angles would not broadcast with them ("meta" stands for the GPU)."""
    from nanoserve.model.rope import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(5, device="meta"), 8, 10000.0)
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (5, 8)


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
