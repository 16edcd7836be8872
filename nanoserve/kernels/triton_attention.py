"""Chapter 07 — the "triton" attention backend: the engine's AttentionFn made of this chapter's two kernels.

    attn(layer_idx, q, k, v):  store_kv (k, v -> the pool at slot_mapping), then paged_attention (q -> out)

Same contract as chapter 05's PagedAttention, so the model and the scheduler do not change: the model
runner builds one per step. What does not depend on the layer (the metadata on the pool's device, and at
the first layer's call the grid's query blocks, there too) is worked out once per step here.
"""

import torch

from nanoserve.kernels import triton_paged_attention, triton_store_kv
from nanoserve.kv.paged_attention import AttentionMetadata, PagedKVCache


class TritonPagedAttention:
    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata, paged_attention=None, store_kv=None):
        """paged_attention: the module whose `paged_attention` and `launch_config` to use, store_kv: the module
        whose `store_kv` to use (default: the reference's; `LLM(student=True)` passes the learner's exercises/07
        modules)."""
        self.cache = cache
        self.kernels = paged_attention or triton_paged_attention
        self.store = store_kv or triton_store_kv
        device = cache.k_cache[0].device
        self.slot_mapping = metadata.slot_mapping.to(device)
        self.block_tables = metadata.block_tables.to(device)
        self.seq_lens = metadata.seq_lens.to(device)
        self.cu_seqlens_q = metadata.cu_seqlens_q.to(device)
        self.cu_list = metadata.cu_seqlens_q.tolist()
        self.query_block_index = None  # the grid's query blocks: they depend on the head counts, known at the 1st call

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k_cache[layer_idx], self.cache.v_cache[layer_idx]
        self.store.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.query_block_index is None:
            block_q = self.kernels.launch_config(q.shape[1], k.shape[1], q.shape[2])["BLOCK_Q"]
            # built on the host, copied to the pool's device once: every later layer passes it as it is
            blocks = self.kernels.query_blocks(self.cu_list, block_q)
            self.query_block_index = tuple(t.to(k_cache.device) for t in blocks)
        return self.kernels.paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q,
                                            self.query_block_index)
