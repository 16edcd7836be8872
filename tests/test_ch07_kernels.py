"""Chapter 07 — the Triton kernels, run by Triton's interpreter on the CPU, against chapter 05's torch path.

Paged attention: the kernel == chapter 05's PagedAttention (itself checked against attention written out
in tests/test_ch05_paged_attention.py) on the same pool, over block sizes 4 and 16, GQA ratios 1, 3, 4,
ragged lengths (1, exact block boundaries, partial tail blocks), whole prompts, chunks on a cached prefix
and a mixed step. The pool's blocks are dealt shuffled, so block tables are not contiguous.
Store-KV: the kernel writes exactly what chapter 05's index_copy_ writes.

The graded tests (exercise 7.1) take the kernel from `implementation(...)`: the reference, or the
learner's exercises/07 file under `make grade CH=07`.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined: @triton.jit reads it then

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from nanoserve.kernels.triton_store_kv import store_kv  # noqa: E402
from nanoserve.kv.block_manager import slot_mapping  # noqa: E402
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache  # noqa: E402
from nanoserve.student import implementation  # noqa: E402
from tests.test_ch05_paged_attention import random_batch  # noqa: E402


def kernel():
    return implementation("nanoserve.kernels.triton_paged_attention")


def make_step(num_kv_heads, group, head_dim, block_size, seq_lens, query_lens, dtype=torch.float32, seed=0):
    """A pool with every sequence's cached prefix (its first seq_len - query_len positions) in shuffled blocks,
    and this step's q, k, v for the rest. Returns (cache, metadata, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 3))  # room to spare: some blocks stay unused (zeros)
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    cache = PagedKVCache(1, sum(need) + 3, block_size, num_kv_heads, head_dim, dtype)
    for table, s, n in zip(tables, seq_lens, query_lens):
        k, v = (torch.randn(s - n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        cache.store_kv(0, k, v, torch.tensor(slot_mapping(table, 0, s - n, block_size), dtype=torch.long))
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, block_size)
    N = sum(query_lens)
    q = torch.randn(N, num_kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(N, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    return cache, meta, q, k, v


def compare(cache, meta, q, k, v, tol=1e-4, **launch):
    """Chapter 05's PagedAttention stores k, v and attends; the kernel then reads the same pool."""
    expected = PagedAttention(cache, meta)(0, q, k, v)  # (N, H, D)
    out = kernel().paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                   meta.cu_seqlens_q, **launch)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    err = (out.float() - expected.float()).abs().max().item()
    assert err < tol, f"max abs diff {err}"


CASES = {  # name: (seq_lens, query_lens)
    "decodes, ragged": ([1, 4, 5, 16, 33, 70], [1] * 6),  # length 1, exact boundaries, partial tails, many tiles
    "whole prompts": ([1, 16, 7, 40], [1, 16, 7, 40]),
    "chunks on a cached prefix": ([24, 9, 70], [8, 5, 30]),
    "mixed step": ([13, 1, 48, 32, 20], [1, 1, 48, 16, 1]),  # decodes, a whole prompt, a chunk
}


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_equals_torch_paged_attention(case, block_size, group):
    seq_lens, query_lens = CASES[case]
    # tile 16 < most lengths: the online softmax rescales across tiles; GQA groups of 3 are padded to 4 rows
    compare(*make_step(2, group, 16, block_size, seq_lens, query_lens, seed=block_size + group), tile=16)


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("block_m, tile", [(16, 16), (16, 64), (64, 32)])
def test_kernel_tile_sizes(block_m, tile):
    """SmolLM2's shape (3 kv heads, G = 3, head_dim 64) with the GPU's 16 rows and the interpreter's 64."""
    compare(*make_step(3, 3, 64, 16, [1, 17, 40, 64], [1, 9, 40, 1], seed=tile), block_m=block_m, tile=tile)


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("seed", range(6))
def test_kernel_on_random_batches(seed):
    """Chapter 05's random mixed steps: 1-6 sequences, lengths 1-50, decodes, chunks, whole prompts."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv, G, bs = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4]), rng.choice([4, 16])
    seq_lens, query_lens, tables, num_blocks, q, k_full, v_full = random_batch(rng, Hkv, G, 16, bs)
    cache = PagedKVCache(1, num_blocks, bs, Hkv, 16)
    for table, s, n, k, v in zip(tables, seq_lens, query_lens, k_full, v_full):
        cache.store_kv(0, k[: s - n], v[: s - n], torch.tensor(slot_mapping(table, 0, s - n, bs), dtype=torch.long))
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)
    new_k = torch.cat([k[s - n:] for k, s, n in zip(k_full, seq_lens, query_lens)])
    new_v = torch.cat([v[s - n:] for v, s, n in zip(v_full, seq_lens, query_lens)])
    compare(cache, meta, torch.cat(q), new_k, new_v, tile=16)


@pytest.mark.exercise("7.1")
def test_kernel_float16():
    """fp16 in, fp32 scores and sums inside, fp16 out. (bf16 is left to the GPU: in triton 3.9 the
    interpreter's tl.dot gets bfloat16 inputs wrong — a 16 x 16 bf16 product comes out off by ~1e10.)"""
    compare(*make_step(3, 3, 64, 16, [5, 40, 20], [1, 40, 8], dtype=torch.float16), tol=2e-2, tile=16)


@pytest.mark.exercise("7.1")
def test_kernel_reads_only_its_blocks():
    """Blocks outside every table are filled with NaN after the reference ran: the kernel must not read them
    (padding entries of a block table, keys past seq_len) or a NaN would leak into the output."""
    cache, meta, q, k, v = make_step(2, 3, 16, 4, [7, 12], [3, 1])
    expected = PagedAttention(cache, meta)(0, q, k, v)
    for b in set(range(cache.num_blocks)) - set(meta.block_tables.flatten().tolist()):
        cache.k_cache[0][:, b] = float("nan")
        cache.v_cache[0][:, b] = float("nan")
    for pool in (cache.k_cache[0], cache.v_cache[0]):
        slots = pool.view(2, -1, 16)  # (Hkv, num_slots, D)
        for table, s in zip(meta.block_tables.tolist(), meta.seq_lens.tolist()):
            for pos in range(s, -(-s // 4) * 4):  # the tail block's rows past seq_len
                slots[:, table[pos // 4] * 4 + pos % 4] = float("nan")
    out = kernel().paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                   meta.cu_seqlens_q, tile=16)
    assert (out - expected).abs().max() < 1e-4


@pytest.mark.parametrize("num_kv_heads, head_dim, block_size, block_t", [(2, 16, 4, 16), (3, 64, 16, 4), (1, 8, 1, 2)])
def test_store_kv_equals_index_copy(num_kv_heads, head_dim, block_size, block_t):
    """SmolLM2's 3 kv heads pad to 4 rows (192 = 3 · 64 is not a power of two); every other slot untouched."""
    g = torch.Generator().manual_seed(head_dim)
    reference = PagedKVCache(1, 6, block_size, num_kv_heads, head_dim)
    reference.k_cache[0].normal_(generator=g)
    reference.v_cache[0].normal_(generator=g)
    k_cache, v_cache = reference.k_cache[0].clone(), reference.v_cache[0].clone()
    slots = torch.randperm(6 * block_size, generator=g)[:5]
    k, v = torch.randn(5, num_kv_heads, head_dim, generator=g), torch.randn(5, num_kv_heads, head_dim, generator=g)
    reference.store_kv(0, k, v, slots)
    store_kv(k, v, k_cache, v_cache, slots, block_t)  # 5 tokens: a partly filled last program
    assert torch.equal(k_cache, reference.k_cache[0]) and torch.equal(v_cache, reference.v_cache[0])


def test_store_kv_takes_strided_inputs_and_refuses_mismatches():
    """k, v as the model hands them over: views into one (N, 2 · Hkv · D) projection output."""
    kv = torch.randn(3, 2, 2, 16)  # (N, k|v, Hkv, D)
    reference = PagedKVCache(1, 2, 4, 2, 16)
    k_cache, v_cache = reference.k_cache[0].clone(), reference.v_cache[0].clone()
    slots = torch.tensor([7, 0, 3])
    store_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    reference.store_kv(0, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(k_cache, reference.k_cache[0]) and torch.equal(v_cache, reference.v_cache[0])
    with pytest.raises(ValueError, match="do not agree"):
        store_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots[:2])


def test_kernel_refuses_a_query_that_does_not_fit_the_pool():
    cache, meta, q, k, v = make_step(2, 3, 16, 4, [5], [1])
    with pytest.raises(ValueError, match="does not fit the pool"):
        kernel().paged_attention(q[:, :5], cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q)  # 5 query heads for 2 kv heads
