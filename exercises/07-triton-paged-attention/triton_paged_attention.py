"""Exercise 7.1 — the inner tile loop of the paged attention kernel: the online softmax, in Triton.

This file mirrors nanoserve/kernels/triton_paged_attention.py. Everything but the online softmax is
given: the kernel below finds its rows (query token x head of the GQA group), loads its queries, walks
its sequence's block table TILE keys at a time (the pointer arithmetic) and calls YOUR
`online_softmax_step` once per tile; the launch code is the reference's.

What to write, per tile (chapter 07, and nanoserve/kernels/online_softmax.py does it in torch):

    scores  = q · kᵀ · sm_scale                       tl.dot(q, tl.trans(k), input_precision="ieee")
    mask    key_pos <= query_pos (causal) and key_pos < num_keys (the tail): elsewhere -inf
    m_new   = max(m_i, row max of the scores)
    alpha   = exp(m_i - m_new)                        rescales what was summed under the old max
    p       = exp(scores - m_new)
    l_i     = l_i · alpha + row sum of p
    acc     = acc · alpha + p · v                     tl.dot(p.to(v.dtype), v, input_precision="ieee")

then delete the `raise NotImplementedError` in `paged_attention` below. Grade it with `make grade CH=07`
(it runs under Triton's interpreter on the CPU); serve with it: see README.md.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.triton_paged_attention import launch, launch_config, query_blocks  # noqa: F401


@triton.jit
def online_softmax_step(q, k, v, query_pos, key_pos, num_keys, m_i, l_i, acc, sm_scale):
    """One tile of the online softmax.

    q (BLOCK_M, D_PAD) queries, k/v (TILE, D_PAD) this tile's keys and values, query_pos (BLOCK_M,) and
    key_pos (TILE,) positions in the sequence, num_keys: keys this program may read at all.
    m_i, l_i (BLOCK_M,) running max and running sum, acc (BLOCK_M, D_PAD) the unnormalised output.
    Returns the new (m_i, l_i, acc).
    """
    # Exercise 7.1: your code here (tl.dot, tl.trans, tl.where, tl.maximum, tl.max, tl.exp, tl.sum)
    return m_i, l_i, acc


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_block_seq_ptr, q_block_start_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out: (num_tokens, H, D), last stride 1
    stride_kh, stride_kb, stride_ks,  # pool: (Hkv, num_blocks, block_size, D), last stride 1
    stride_bt,  # block_tables: (num_seqs, max_blocks)
    sm_scale,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
):
    qb, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(q_block_seq_ptr + qb)
    q_first = tl.load(q_block_start_ptr + qb)  # this block's first query, counted within the sequence
    token_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - token_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step: query i sits at position context_len + i

    # rows = (query token, head of the group) pairs
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    q_idx = q_first + rows // G_PAD  # (BLOCK_M,) query within the sequence
    head = kv_head * G + rows % G_PAD  # (BLOCK_M,) query head
    row_ok = (q_idx < q_len) & (rows % G_PAD < G)
    query_pos = context_len + q_idx
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    token = (token_begin + q_idx).to(tl.int64)  # int64 offsets: a big batch or pool overflows int32 on a GPU
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D_PAD)

    m_i = tl.full((BLOCK_Q * G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * G_PAD, D_PAD), tl.float32)

    # the keys the block's last query sees: everything up to its position, nothing after
    num_keys = tl.minimum(seq_len, context_len + q_first + BLOCK_Q)
    head_base = kv_head.to(tl.int64) * stride_kh
    for tile_start in range(0, num_keys, TILE):
        # the block walk: key position -> (physical block from the table, row inside the block)
        key_pos = tile_start + tl.arange(0, TILE)  # (TILE,)
        key_ok = key_pos < num_keys
        block = tl.load(block_tables_ptr + seq * stride_bt + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
        row_off = head_base + block.to(tl.int64) * stride_kb + (key_pos % BLOCK_SIZE).to(tl.int64) * stride_ks
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (TILE, D_PAD)
        v = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(q, k, v, query_pos, key_pos, num_keys, m_i, l_i, acc, sm_scale)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, query_block_index=None,
                    block_m: int | None = None, tile: int = 64) -> torch.Tensor:
    """q (num_tokens, H, D), k_cache/v_cache (Hkv, num_blocks, block_size, D) -> out (num_tokens, H, D)."""
    raise NotImplementedError("Exercise 7.1: write online_softmax_step, then delete this line")
    return launch(paged_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                  query_block_index, block_m, tile)
