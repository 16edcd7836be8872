"""Chapter 18 — the KV pool in 8 bits: quantize on store, dequantize in the gather.

The pool keeps chapter 05's layout, in int8 or float8_e4m3fn codes, with a bf16 scale beside every row
(kv_quant.py):

    k_cache[layer], v_cache[layer]:  (Hkv, num_blocks, block_size, D)  int8 / fp8 codes
    k_scale[layer], v_scale[layer]:  (Hkv, num_blocks, block_size)     bf16, one per token and kv head

A step (QuantizedPagedAttention), per layer:
 1. store: the step's k, v (N, Hkv, D) are quantized and their codes and scales written at their slots;
 2. gather: only the blocks this step's sequences read (the distinct ids of its block tables, U of them)
    are dequantized, into a small float scratch pool of U blocks; the block tables are renumbered into it
    once per step, and chapter 05's attention runs on the scratch pool unchanged.
So the math is chapter 05's, on keys and values that went through 8 bits — every one of them, the step's
own tokens too (they are attended as their dequantized copies, as a kernel reading the pool would see them).
"""

import torch

from nanoserve.kv.kv_quant import SCALE_DTYPE
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache
from nanoserve.model.config import LlamaConfig

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_block_bytes(config: LlamaConfig, block_size: int) -> int:
    """Bytes of one block of a quantized pool: K and V, every layer and kv head, a 1-byte code per number
    plus a 2-byte scale per row. SmolLM2, 16 tokens: 2 · 30 · 3 · 16 · (64 + 2) = 190,080 B (bf16: 368,640 B)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * (config.head_dim + 2)


class QuantizedKVCache(PagedKVCache):
    """Chapter 05's pool with 8-bit codes and a scale per row. `quant`: the module with quantize_kv and
    dequantize_kv (kv_quant.py, or the learner's exercise 18.3)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.int8, compute_dtype: torch.dtype = torch.float32, device=None, quant=None):
        if dtype not in KV_QUANT_DTYPES.values():
            raise ValueError(f"a quantized pool stores int8 or float8_e4m3fn, not {dtype}")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        if quant is None:
            from nanoserve.kv import kv_quant as quant
        self.quant, self.dtype, self.compute_dtype = quant, dtype, compute_dtype
        shape = (num_kv_heads, num_blocks, block_size)
        self.k_scale = [torch.ones(shape, dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.ones(shape, dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for t in self.k_scale + self.v_scale)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds a block's contents, each (Hkv, num_blocks, ...): what a block copy moves."""
        return self.k_cache + self.v_cache + self.k_scale + self.v_scale

    def store_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v (N, Hkv, D) float: quantized, their codes and scales written at slots slot_mapping (N,)."""
        self.store_codes(layer_idx, *self.quant.quantize_kv(k, self.dtype), *self.quant.quantize_kv(v, self.dtype),
                         slot_mapping)

    def store_codes(self, layer_idx: int, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                    v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Codes (N, Hkv, D) and scales (N, Hkv) of K and V written at slots slot_mapping (N,)."""
        Hkv, D = self.num_kv_heads, self.head_dim
        for q, s, codes, scales in ((k_codes, k_scale, self.k_cache[layer_idx], self.k_scale[layer_idx]),
                                    (v_codes, v_scale, self.v_cache[layer_idx], self.v_scale[layer_idx])):
            # as bytes: index_copy_ has no float8 kernel on the CPU; a byte is a byte
            codes.view(Hkv, -1, D).view(torch.uint8).index_copy_(1, slot_mapping,
                                                                 q.transpose(0, 1).contiguous().view(torch.uint8))
            scales.view(Hkv, -1).index_copy_(1, slot_mapping, s.transpose(0, 1))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = torch.tensor(pairs, dtype=torch.long).T
        for t in self.block_tensors():
            t.view(torch.uint8)[:, dst] = t.view(torch.uint8)[:, src]

    def dequantize_blocks(self, layer_idx: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` (U,) in one layer, dequantized: two (Hkv, U, block_size, D) tensors."""
        return tuple(self.quant.dequantize_kv(codes[:, blocks], scales[:, blocks], self.compute_dtype)
                     for codes, scales in ((self.k_cache[layer_idx], self.k_scale[layer_idx]),
                                           (self.v_cache[layer_idx], self.v_scale[layer_idx])))


class QuantizedPagedAttention(PagedAttention):
    """Chapter 05's PagedAttention over a QuantizedKVCache: the step's blocks are dequantized once per layer
    into a scratch pool of just those blocks, which the float attention reads."""

    def __init__(self, cache: QuantizedKVCache, metadata: AttentionMetadata, batch_decodes: bool = True):
        self.pool, self.slots = cache, metadata.slot_mapping
        bs = cache.block_size
        self.blocks = torch.unique(metadata.block_tables)  # (U,) sorted: every block the step reads (padding's 0 too)
        local = torch.zeros(cache.num_blocks, dtype=torch.long, device=self.blocks.device)
        local[self.blocks] = torch.arange(len(self.blocks), device=self.blocks.device)  # pool id -> scratch id
        scratch_metadata = AttentionMetadata(local[self.slots // bs] * bs + self.slots % bs,
                                             local[metadata.block_tables], metadata.seq_lens, metadata.cu_seqlens_q)
        self.scratch = PagedKVCache(1, len(self.blocks), bs, cache.num_kv_heads, cache.head_dim, cache.compute_dtype,
                                    self.blocks.device)
        super().__init__(self.scratch, scratch_metadata, batch_decodes)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        quant, dtype = self.pool.quant, self.pool.dtype
        k_codes, k_scale = quant.quantize_kv(k, dtype)  # (N, Hkv, D), (N, Hkv)
        v_codes, v_scale = quant.quantize_kv(v, dtype)
        self.pool.store_codes(layer_idx, k_codes, k_scale, v_codes, v_scale, self.slots)  # quantize on store
        keys, values = self.pool.dequantize_blocks(layer_idx, self.blocks)  # dequantize in the gather
        self.scratch.k_cache[0].copy_(keys)
        self.scratch.v_cache[0].copy_(values)
        # the step's own tokens as the pool holds them (their dequantized copies): what any later step reads
        return super().__call__(0, q, quant.dequantize_kv(k_codes, k_scale, self.pool.compute_dtype),
                                quant.dequantize_kv(v_codes, v_scale, self.pool.compute_dtype))
