"""Chapter 05 — paged attention in plain torch: K/V live in blocks, found through block tables.

The pool, per layer:   k_cache[layer], v_cache[layer]: (num_kv_heads, num_blocks, block_size, head_dim)

Heads first: a block of one kv head is a contiguous (block_size, head_dim) tile, so gathering a
sequence's blocks yields its keys as (Hkv, seq_len, D) — the heads-first layout attention wants —
with no transpose copy. (vLLM's GPU layouts differ in detail; each backend picks what its kernel reads best.)

One engine step runs one flat batch of tokens from many sequences (vLLM style). For every layer:

 1. store_kv: this step's k, v (num_tokens, Hkv, D) go to their slots,
        k_cache[layer].view(Hkv, -1, D)[:, slot_mapping] = k.transpose(0, 1)
 2. attend: sequence i's queries are the LAST q_len_i of its seq_lens[i] positions, causal.
    Its keys are gathered through its block table (gather_kv):
        k_cache[layer][:, block_tables[i]]   # (Hkv, blocks, block_size, D) -> first seq_lens[i] rows

Decoding sequences (1 query each) are the common case: they are done in groups of up to 8, sorted
by context length — per group one gather of whole blocks into a padded (Hkv, num_seqs, max_blocks *
block_size, D) tensor, a mask for the padding, and one batched attention call. Sequences
prefilling a chunk (many queries, on top of a cached prefix) go one at a time, with chapter 01's
causal mask and its offset (a whole prompt, with no prefix, needs no mask tensor: is_causal says it).

The attention math itself is torch's fused `F.scaled_dot_product_attention` (on CPU a flash-attention
kernel: the (T, S) scores never exist whole, GQA without repeat_kv copies). It computes what chapter
01 wrote out — the tests check it against attention written out in the test — in one fused call;
this chapter's subject is where K/V live, not the softmax.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from nanoserve.kv.block_manager import cdiv, slot_mapping
from nanoserve.memory import kv_bytes_per_token
from nanoserve.model.attention import causal_mask
from nanoserve.model.config import LlamaConfig

TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DECODE_GROUP = 8  # decoding sequences per padded batch: sorted by length, so padding stays short


def num_blocks_for_budget(config: LlamaConfig, budget_bytes: float, block_size: int = 16,
                          dtype: torch.dtype = torch.float32) -> int:
    """How many KV blocks fit in `budget_bytes` (chapter 04's formula, times block_size tokens).

    SmolLM2, float32: 46,080 B per token · 16 = 720 KiB per block; 1 GiB holds 1456 blocks = 23,296 tokens.
    """
    return int(budget_bytes // (kv_bytes_per_token(config, TORCH_DTYPE_NAMES[dtype]) * block_size))


class PagedKVCache:
    """The pool of KV blocks: one K and one V tensor per layer. Zero-filled, so padding read by a
    batched gather is finite (it is masked out, and 0 · finite = 0; garbage could be NaN)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config: LlamaConfig, budget_bytes: float, block_size: int = 16,
                  dtype: torch.dtype = torch.float32, device=None) -> "PagedKVCache":
        """A pool for `config` that fills `budget_bytes`."""
        num_blocks = num_blocks_for_budget(config, budget_bytes, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim,
                   dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k_cache + self.v_cache)

    def store_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (num_tokens, Hkv, D) written at slots slot_mapping (num_tokens,): slot = block · block_size + offset."""
        if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                             f"{tuple(slot_mapping.shape)} must agree on num_tokens")
        Hkv, D = self.num_kv_heads, self.head_dim
        # the pool seen as (Hkv, num_slots, D): slot s of kv head j is row s of head j
        self.k_cache[layer_idx].view(Hkv, -1, D).index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v_cache[layer_idx].view(Hkv, -1, D).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write after a fork: BlockManager.take_copies)."""
        if not pairs:
            return
        src, dst = torch.tensor(pairs, dtype=torch.long).T
        for cache in self.k_cache + self.v_cache:
            cache[:, dst] = cache[:, src]


@dataclass
class AttentionMetadata:
    """One step's flat batch: which tokens belong to which sequence, and where their K/V live."""

    slot_mapping: torch.Tensor  # (num_tokens,) pool row of each new token's K/V
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) long, padded with block 0
    seq_lens: torch.Tensor  # (num_seqs,) context length of each sequence AFTER this step's tokens
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) sequence i's queries are tokens cu[i]:cu[i+1] of the batch

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int) -> "AttentionMetadata":
        """From integers (the block manager's tables): sequence i computes positions
        [seq_lens[i] - query_lens[i], seq_lens[i]).

        >>> m = AttentionMetadata.build([[3], [0, 2]], seq_lens=[3, 6], query_lens=[3, 1], block_size=4)
        >>> m.slot_mapping.tolist(), m.block_tables.tolist(), m.cu_seqlens_q.tolist()
        ([12, 13, 14, 9], [[3, 0], [0, 2]], [0, 3, 4])
        """
        if not len(block_tables) == len(seq_lens) == len(query_lens):
            raise ValueError(f"block_tables ({len(block_tables)}), seq_lens ({len(seq_lens)}) and query_lens "
                             f"({len(query_lens)}) must have one entry per sequence")
        slots, cu = [], [0]
        for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
            if not 1 <= q_len <= seq_len:
                raise ValueError(f"query_len {q_len} must be in 1..seq_len ({seq_len})")
            slots += slot_mapping(table, seq_len - q_len, seq_len, block_size)
            cu.append(cu[-1] + q_len)
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return cls(torch.tensor(slots, dtype=torch.long), torch.tensor(padded, dtype=torch.long),
                   torch.tensor(seq_lens, dtype=torch.long), torch.tensor(cu, dtype=torch.long))


class PagedAttention:
    """The AttentionFn of one step: attn(layer_idx, q (N, H, D), k, v (N, Hkv, D)) -> (N, H, D).

    Everything that does not depend on the layer — which sequences decode, the gather indices, the
    padding mask — is worked out once here, then reused by all layers.
    """

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata, batch_decodes: bool = True):
        """batch_decodes=False sends every sequence down the one-at-a-time path (the baseline that
        `python -m nanoserve bench paged-kv` measures the batched decode against)."""
        self.cache, self.metadata = cache, metadata
        bs = cache.block_size
        cu = metadata.cu_seqlens_q.tolist()
        seq_lens = metadata.seq_lens.tolist()
        q_lens = [b - a for a, b in zip(cu, cu[1:])]
        decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1 and batch_decodes]
        # Decodes are padded to the longest context of their group, so group them by length: sorted, in
        # groups of DECODE_GROUP, a short sequence is not padded to the longest one in the whole batch.
        decodes.sort(key=lambda i: seq_lens[i])
        self.decode_groups = [DecodeGroup(cache, metadata, decodes[g:g + DECODE_GROUP])
                              for g in range(0, len(decodes), DECODE_GROUP)]
        # the rest (prefill chunks), one by one: (first token, last token + 1, context length, its block
        # table, its (T, S) causal mask). A whole prompt (T = S) gets None and goes to the kernel as
        # is_causal, which skips the key blocks above the diagonal instead of reading a mask that hides them
        # (about half a prompt's scores never computed); a chunk on top of a cached prefix needs the mask, made
        # where the pool is (a GPU's pool with a CPU mask fails in the attention call) and in its dtype.
        # The engine builds the metadata on the host: what the pool's device reads (the slots, the block tables)
        # is copied there once per step here, not by every layer (a GPU's pool indexed by CPU tensors fails).
        pool = cache.k_cache[0]
        self.slot_mapping = metadata.slot_mapping.to(pool.device)
        self.prefills = [(cu[i], cu[i + 1], seq_lens[i], metadata.block_tables[i, :cdiv(seq_lens[i], bs)].to(pool.device),
                          None if q_len == seq_lens[i] else causal_mask(q_len, seq_lens[i], pool.device, pool.dtype))
                         for i, q_len in enumerate(q_lens) if q_len > 1 or not batch_decodes]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k_cache[layer_idx], self.cache.v_cache[layer_idx]
        # A bf16 pool under a float32 model (kv_cache_dtype="bf16"): the attention math runs in the pool's dtype
        # (half the bytes to gather and read), its output goes back to the model's.
        model_dtype, q, k, v = q.dtype, q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
        self.cache.store_kv(layer_idx, k, v, self.slot_mapping)
        out = torch.empty_like(q)
        for group in self.decode_groups:
            out[group.tokens] = group.attend(q[group.tokens], k_cache, v_cache)
        for start, end, seq_len, table, mask in self.prefills:
            out[start:end] = attend_sequence(q[start:end], k_cache, v_cache, table, seq_len, mask)
        return out.to(model_dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) from one layer's pool, dense and in position order.

    cache (Hkv, num_blocks, block_size, D), block_table (>= cdiv(seq_len, block_size),) -> (Hkv, seq_len, D):
    position p is row p % block_size of block block_table[p // block_size]; the tail of the last block is cut.

    >>> cache = torch.arange(6.).view(1, 3, 2, 1)                 # 1 kv head, 3 blocks of 2 slots, D = 1
    >>> gather_kv(cache, torch.tensor([2, 0]), 3).flatten().tolist()   # positions 0, 1 in block 2; 2 in block 0
    [4.0, 5.0, 0.0]
    """
    return cache[:, block_table].flatten(1, 2)[:, :seq_len]


def attend_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's T queries q (T, H, D) — the last T of its seq_len positions — against its K/V in the pool.

    mask: the (T, seq_len) additive causal mask with its offset (chapter 01), or None for a whole prompt
    (T == seq_len), which the kernel's is_causal handles without a mask tensor. Returns (T, H, D).
    """
    keys, values = gather_kv(k_cache, block_table, seq_len), gather_kv(v_cache, block_table, seq_len)  # (Hkv, S, D)
    # a batch of one (torch takes its flash kernel for 4-d inputs only): (1, H, T, D) queries against (1, Hkv, S, D)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                       attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return o[0].transpose(0, 1)  # (T, H, D)


class DecodeGroup:
    """Decoding sequences (one query each) attended all at once: one gather of whole blocks into a padded
    (Hkv, num_seqs, max_blocks · block_size, D) tensor, a padding mask, one batched attention call."""

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata, seqs: list[int]):
        bs, Hkv = cache.block_size, cache.num_kv_heads
        dtype, device = cache.k_cache[0].dtype, cache.k_cache[0].device
        # the metadata may be on the host (the engine's) or already on the pool's device (bench attention's):
        # what follows is worked out on the pool's device
        self.tokens = metadata.cu_seqlens_q[seqs].to(device)  # each decode's one query token in the flat batch
        seq_lens = metadata.seq_lens[seqs]  # (Sd,)
        tables = metadata.block_tables[seqs, :cdiv(int(seq_lens.max()), bs)].to(device)  # (Sd, MB)
        seq_lens = seq_lens.to(device)
        # One index into the pool seen as (Hkv · num_blocks, block_size, D): block b of kv head j is
        # tile j · num_blocks + b. Gathering whole tiles moves contiguous block_size · D runs, one index op.
        heads = torch.arange(Hkv, device=tables.device)  # on the pool's device
        self.tiles = (heads[:, None] * cache.num_blocks + tables.flatten()[None, :]).flatten()  # (Hkv·Sd·MB,)
        positions = torch.arange(tables.shape[1] * bs, device=tables.device)  # (C,) with C = MB · block_size
        padding = positions[None, :] >= seq_lens[:, None]  # (Sd, C)
        # additive (0 / -inf), built once per step: a bool mask would be converted again by every layer's call
        mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill(padding, float("-inf"))
        self.mask = mask[:, None, None, :]  # (Sd, 1, 1, C)
        # Gather buffers, allocated once per step and refilled by every layer: a fresh multi-MB tensor
        # per layer would cost allocator work (and page faults) that can take as long as the copy.
        shape = (len(self.tiles), bs, cache.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One query per sequence, all sequences at once. q: (Sd, H, D) -> (Sd, H, D)."""
        Sd, H, D = q.shape
        Hkv, _, bs, _ = k_cache.shape
        # the pool as (Hkv · num_blocks, block_size, D) tiles -> gathered (Hkv, Sd, C, D)
        keys = torch.index_select(k_cache.view(-1, bs, D), 0, self.tiles, out=self.keys).view(Hkv, Sd, -1, D)
        values = torch.index_select(v_cache.view(-1, bs, D), 0, self.tiles, out=self.values).view(Hkv, Sd, -1, D)
        # GQA: the G = H / Hkv query heads that share kv head j (heads j·G .. j·G + G - 1) act as G queries
        # of that one head, so every K/V row is read once: (Sd, Hkv, G, D) queries against (Sd, Hkv, C, D)
        # keys (a transposed view; each (sequence, head) run of C·D floats stays contiguous), padding masked.
        out = F.scaled_dot_product_attention(q.view(Sd, Hkv, H // Hkv, D), keys.transpose(0, 1),
                                             values.transpose(0, 1), attn_mask=self.mask)
        return out.reshape(Sd, H, D)
