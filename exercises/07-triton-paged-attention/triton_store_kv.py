"""Exercise 7.2 — the store-KV kernel: this step's new K/V written into the pool through slot_mapping.

This file mirrors nanoserve/kernels/triton_store_kv.py (read its module docstring, not its kernel).
`store_kv` below (given) checks the shapes and launches YOUR store_kv_kernel over ceil(N / BLOCK_T)
programs; chapter 05's `PagedKVCache.store_kv` (index_copy_) is the answer it must equal.
"""

import torch
import triton  # noqa: F401
import triton.language as tl

from nanoserve.kernels.triton_store_kv import launch_store_kv


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
                    stride_kt, stride_kh, stride_vt, stride_vh,  # k, v: (num_tokens, Hkv, D), last stride 1
                    stride_ch, stride_cb, stride_cs,  # the pool: (Hkv, num_blocks, block_size, D), last stride 1
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Exercise 7.2: program i writes tokens i·BLOCK_T .. i·BLOCK_T + BLOCK_T - 1 (those < num_tokens).

    Token t's keys k[t] (NUM_KV_HEADS, HEAD_DIM) and values v[t] go to slot slot_mapping[t] (int32 or
    int64) of every kv head: k_cache[h, block, row] = k[t, h] for each head h, where the slot is row `row`
    of physical block `block` of BLOCK_SIZE rows. H_PAD, D_PAD: NUM_KV_HEADS and HEAD_DIM rounded up to
    powers of two. Writes nothing else: every other slot, and every padding head and dim, stays as it was.

    BLOCK_SIZE 4, slot_mapping [9, 2]: token 0 goes to block 2, row 1 (k_cache[h, 2, 1] = k[0, h] for every h);
    token 1 to block 0, row 2. With BLOCK_T 16 there is one program, and its lanes 2..15 load and store nothing.
    """
    raise NotImplementedError("Exercise 7.2: write store_kv_kernel")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, block_t: int = 16) -> None:
    """k, v (num_tokens, Hkv, D) -> k_cache, v_cache (Hkv, num_blocks, block_size, D) at slot_mapping (num_tokens,).
    Given: launches this file's store_kv_kernel."""
    launch_store_kv(store_kv_kernel, k, v, k_cache, v_cache, slot_mapping, block_t)
