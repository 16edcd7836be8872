"""Chapter 07 — the store-KV kernel: this step's new K/V written into the pool through slot_mapping.

One program per new token t: its slot s = slot_mapping[t] is block s // block_size, row s % block_size,
and the token's (Hkv, D) keys and values land in row s % block_size of that block, for every kv head
(the pool is heads first: (Hkv, num_blocks, block_size, D)). The same job as chapter 05's

    k_cache.view(Hkv, -1, D).index_copy_(1, slot_mapping, k.transpose(0, 1))

(nano-vllm's `store_kvcache`). (head, dim) are indexed in 2-D: tl.arange needs powers of two, and
SmolLM2's Hkv · D = 3 · 64 = 192 is not one; padded to (4, 64), the padding row is masked off.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.backend import check_launchable


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,  # k, v: (num_tokens, Hkv, D), last stride 1
                    stride_ch, stride_cs,  # the pool seen as (Hkv, num_slots, D)
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)  # int64: slot · stride overflows int32 in a big pool
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + h * stride_kh + d, mask=mask)  # (H_PAD, D_PAD)
    v = tl.load(v_ptr + src * stride_vt + h * stride_vh + d, mask=mask)
    dst = h.to(tl.int64) * stride_ch + slot * stride_cs + d  # block · block_size + row = slot
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v (num_tokens, Hkv, D) -> k_cache, v_cache (Hkv, num_blocks, block_size, D) at slot_mapping (num_tokens,)."""
    check_launchable(store_kv_kernel, k.device)
    N, Hkv, D = k.shape
    if v.shape != k.shape or slot_mapping.shape != (N,) or k_cache.shape[0] != Hkv or k_cache.shape[-1] != D:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
                         f"and the pool {tuple(k_cache.shape)} do not agree")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if N == 0:
        return
    store_kv_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          k_cache.stride(0), k_cache.stride(2), NUM_KV_HEADS=Hkv, HEAD_DIM=D,
                          H_PAD=triton.next_power_of_2(Hkv), D_PAD=triton.next_power_of_2(D))
