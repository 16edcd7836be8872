"""Chapter 07 — the store-KV kernel: this step's new K/V written into the pool through slot_mapping.

One program per BLOCK_T new tokens: token t's slot s = slot_mapping[t] is row s % block_size of
physical block s // block_size, and its (Hkv, D) keys and values land there, for every kv head (the
pool is heads first: (Hkv, num_blocks, block_size, D)). The same job as chapter 05's

    k_cache.view(Hkv, -1, D).index_copy_(1, slot_mapping, k.transpose(0, 1))

(nano-vllm's `store_kvcache`). (head, dim) are indexed as two axes: tl.arange needs powers of two, and
SmolLM2's Hkv · D = 3 · 64 = 192 is not one; padded to (4, 64), the padding row is masked off.
Exercise 7.2 writes `store_kv_kernel`.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.backend import check_launchable, stub_errors_unwrapped


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
                    stride_kt, stride_kh, stride_vt, stride_vh,  # k, v: (num_tokens, Hkv, D), last stride 1
                    stride_ch, stride_cb, stride_cs,  # the pool: (Hkv, num_blocks, block_size, D), last stride 1
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Exercise 7.2: program i writes tokens i·BLOCK_T .. i·BLOCK_T + BLOCK_T - 1 (those < num_tokens)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) this program's tokens
    t_ok = t < num_tokens  # the last program's tail
    # int64: block · stride overflows int32 in a pool of more than 2**31 elements
    slot = tl.load(slot_mapping_ptr + t, mask=t_ok, other=0).to(tl.int64)
    block = (slot // BLOCK_SIZE)[:, None, None]  # (BLOCK_T, 1, 1)
    row = (slot % BLOCK_SIZE)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]  # (1, H_PAD, 1)
    d = tl.arange(0, D_PAD)[None, None, :]  # (1, 1, D_PAD)
    mask = t_ok[:, None, None] & (h < NUM_KV_HEADS) & (d < HEAD_DIM)  # (BLOCK_T, H_PAD, D_PAD)
    src = t.to(tl.int64)[:, None, None]
    k = tl.load(k_ptr + src * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + src * stride_vt + h * stride_vh + d, mask=mask)
    dst = h.to(tl.int64) * stride_ch + block * stride_cb + row * stride_cs + d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, block_t: int = 16) -> None:
    """k, v (num_tokens, Hkv, D) -> k_cache, v_cache (Hkv, num_blocks, block_size, D) at slot_mapping (num_tokens,).
    block_t tokens per program."""
    launch_store_kv(store_kv_kernel, k, v, k_cache, v_cache, slot_mapping, block_t)


def launch_store_kv(kernel, k, v, k_cache, v_cache, slot_mapping, block_t: int = 16) -> None:
    """Launch `kernel` (store_kv_kernel's signature: this module's, or exercise 7.2's) over ceil(N / block_t)
    programs, after checking that the shapes agree."""
    check_launchable(kernel, k.device)
    N, Hkv, D = k.shape
    if v.shape != k.shape or slot_mapping.shape != (N,) or k_cache.shape[0] != Hkv or k_cache.shape[-1] != D \
            or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
                         f"and the pool {tuple(k_cache.shape)} do not agree")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if N == 0:
        return
    with stub_errors_unwrapped():
        kernel[(triton.cdiv(N, block_t),)](
            k, v, k_cache, v_cache, slot_mapping, N, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=Hkv, HEAD_DIM=D,
            BLOCK_SIZE=k_cache.shape[2], H_PAD=triton.next_power_of_2(Hkv), D_PAD=triton.next_power_of_2(D),
            BLOCK_T=block_t)
