"""Exercise 7.1 — the inner tile loop of the paged attention kernel: the online softmax, in Triton.

This file mirrors nanoserve/kernels/triton_paged_attention.py. Everything but the online softmax is
given, in that file: its `paged_attention_kernel` finds a program's rows (query token x head of the GQA
group), loads its queries, walks its sequence's block table TILE keys at a time (the pointer arithmetic)
and calls the tile update it is launched with once per tile. `paged_attention` below launches it with
YOUR `online_softmax_step` (Triton compiles a jit function passed as a constexpr into the kernel).

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
import triton.language as tl  # noqa: F401  (you will want tl.dot, tl.where, ...)

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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, query_block_index=None,
                    block_m: int | None = None, tile: int = 64) -> torch.Tensor:
    """q (num_tokens, H, D), k_cache/v_cache (Hkv, num_blocks, block_size, D) -> out (num_tokens, H, D)."""
    raise NotImplementedError("Exercise 7.1: write online_softmax_step, then delete this line")
    return launch(online_softmax_step, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                  query_block_index, block_m, tile)
