"""Exercises 7.1, 7.3 and 7.4 — the paged attention kernel in Triton, one @triton.jit function per rung.

This file mirrors nanoserve/kernels/triton_paged_attention.py (read its module docstring, not its
functions). The kernel is three functions; each rung is graded alone (`make grade CH=07 EX=7.3`): while
you write one, the reference's other two stand in for yours.

    7.1  online_softmax_step     the tile update of the online softmax
    7.3  load_kv_tile            the block walk: a tile of key positions -> K and V rows of the pool
    7.4  paged_attention_kernel  one program: GQA row packing, scores, the causal mask, the loop, the store

`paged_attention` below (given) launches YOUR paged_attention_kernel with YOUR online_softmax_step and
load_kv_tile as its STEP and KV_TILE arguments (Triton compiles a jit function passed as a constexpr into
the kernel). The interpreter (TRITON_INTERPRET=1, which the tests set) runs them on the CPU.
Exercise 7.2, the store-KV kernel, is triton_store_kv.py next to this file.
"""

import torch
import triton  # noqa: F401
import triton.language as tl

from nanoserve.kernels.triton_paged_attention import (  # noqa: F401
    NUM_STAGES, NUM_WARPS, launch, launch_config, query_blocks)


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc):
    """Exercise 7.1, the tile update of the online softmax (nanoserve/kernels/online_softmax.py, in torch).

    scores (BLOCK_M, TILE) float32, already scaled and masked (-inf where a row may not see a key);
    v (TILE, D_PAD) the tile's values; m_i, l_i (BLOCK_M,) the running max and sum of exp(score - m_i);
    acc (BLOCK_M, D_PAD) the running sum of exp(score - m_i) · v. Returns the new (m_i, l_i, acc).
    A row that sees no key of the tile (all -inf) keeps its m_i, l_i and acc once it has seen a key (m_i
    finite). Before that, m_i and the tile's max are both -inf, and exp(-inf - -inf) is NaN: the kernel
    never gets there, since its tile 0 holds key 0, which every row sees.

    One row, D = 1, starting from m = -inf, l = 0, acc = 0:
        tile 1: scores [1, 2],    v [1, 3]   ->  m = 2, l = e^-1 + 1 = 1.368,  acc = e^-1 · 1 + 3 = 3.368
        tile 2: scores [4, -inf], v [10, 0]  ->  m = 4, l = 1.368 · e^-2 + 1 = 1.185,  acc = 3.368 · e^-2 + 10 = 10.456
        acc / l = 8.823 = softmax([1, 2, 4]) · [1, 3, 10]
    """
    raise NotImplementedError("Exercise 7.1: write online_softmax_step")


@triton.jit
def load_kv_tile(k_head_ptr, v_head_ptr, table_ptr, tile_start, num_keys, stride_kb, stride_ks,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr):
    """Exercise 7.3, the block walk: the K and V of key positions tile_start .. tile_start + TILE - 1.

    k_head_ptr, v_head_ptr: one kv head's part of the pool, (num_blocks, block_size, D) with strides
    (stride_kb, stride_ks, 1); table_ptr: the sequence's row of the block table (logical -> physical block).
    Returns k, v (TILE, D_PAD) — 0 for positions >= num_keys and for the padding dims >= HEAD_DIM — and
    key_pos (TILE,). Reads no block the table does not name for a position < num_keys, and nothing at all
    for a position >= num_keys (the table's entries past the sequence's blocks are padding).

    BLOCK_SIZE 4, the table [5, 2], tile_start 0, TILE 8, num_keys 6:
        key_pos  0 1 2 3 4 5 6 7
        block    5 5 5 5 2 2 - -     (- : masked, not read)
        row      0 1 2 3 0 1 - -     k[p] = the pool's row `row` of block `block` (this kv head); k[6] = k[7] = 0
    """
    raise NotImplementedError("Exercise 7.3: write load_kv_tile")


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_block_seq_ptr, q_block_start_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out: (num_tokens, H, D), last stride 1
    stride_kh, stride_kb, stride_ks,  # pool: (Hkv, num_blocks, block_size, D), last stride 1
    stride_bt,  # block_tables: (num_seqs, max_blocks)
    sm_scale,
    STEP: tl.constexpr,  # the tile update: STEP(scores, v, m_i, l_i, acc) -> (m_i, l_i, acc)   (7.1)
    KV_TILE: tl.constexpr,  # the block walk: load_kv_tile's signature -> (k, v, key_pos)      (7.3)
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
):
    """Exercise 7.4: program (qb, j) of the grid (number of query blocks, Hkv).

    Query block qb is the BLOCK_Q query tokens q_block_start[qb] .. + BLOCK_Q - 1 (counted within their
    sequence, the tail past the sequence's query count masked) of sequence s = q_block_seq[qb]; the
    sequence's queries are the flat tokens cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1, the last of its
    seq_lens[s] positions. The program serves those tokens for the G = H / Hkv query heads of kv head j:
    BLOCK_Q · G_PAD rows of (token, head), each loading its q row (HEAD_DIM of D_PAD dims real).
    For each TILE of key positions it gets K and V from KV_TILE, computes sm_scale · q·kᵀ in float32,
    hides from each row the keys its query may not see (causal, by position), and hands the scores to
    STEP. It writes acc / l of every real row to out (in out's dtype) and nothing else.

    SmolLM2's shape, G = 3 padded to G_PAD = 4, BLOCK_Q = 4: the 16 rows are (token r // 4, head j·3 + r % 4),
    rows 3, 7, 11 and 15 padding. A 5-token chunk on a 10-token cached prefix (seq_len 15): its query i sits at
    position 10 + i and sees keys 0 .. 10 + i; its second query block holds query 4 alone (rows 0, 1, 2 real, the rest padding).
    """
    raise NotImplementedError("Exercise 7.4: write paged_attention_kernel")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, query_block_index=None,
                    block_m: int | None = None, tile: int = 64, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES, partition_size: int | None = None) -> torch.Tensor:
    """q (num_tokens, H, D), k_cache/v_cache (Hkv, num_blocks, block_size, D) -> out (num_tokens, H, D).
    Given: launches this file's three functions (the reference's for a rung not written yet). partition_size:
    the reference's split-KV kernels (chapter 07, section 9) with your online_softmax_step and load_kv_tile."""
    return launch(paged_attention_kernel, online_softmax_step, load_kv_tile, q, k_cache, v_cache, block_tables,
                  seq_lens, cu_seqlens_q, query_block_index, block_m, tile, num_warps, num_stages, partition_size)
