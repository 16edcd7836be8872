"""Exercises 5.3 (AttentionMetadata.build), 5.5 (paged attention, one sequence at a time) and 5.6 (the
batched decode gather) — the tensor side of the paged KV cache.

Your version of nanoserve/kv/paged_attention.py. The pool (PagedKVCache: store_kv, copy_blocks) and its
sizing are given; you write the rungs. Grade one with `make grade CH=05 EX=5.5` (5.3, 5.5, 5.6); README.md
has the design questions to answer first.

The pool, per layer:   k_cache[layer], v_cache[layer]: (Hkv, num_blocks, block_size, D), heads first
One step's flat batch: q (num_tokens, H, D), k and v (num_tokens, Hkv, D); sequence i's queries are rows
cu_seqlens_q[i]:cu_seqlens_q[i + 1], the LAST q_len_i of its seq_lens[i] positions, causal. GQA: query
head h reads kv head h // (H // Hkv).
Dtypes: the pool may be narrower than the model. `serve`'s default pool is bf16 (--kv-cache-dtype) under a
model whose q, k, v are float32: PagedAttention stores and attends in the pool's dtype and returns the model's;
attend_sequence and DecodeGroup get q in the pool's dtype, and whatever they allocate (gather buffers, masks)
is in the pool's dtype too.
"""

import torch  # noqa: F401  (you will want it)
from torch.nn import functional as F  # noqa: F401  (F.scaled_dot_product_attention)

from nanoserve.kv.block_manager import cdiv, slot_mapping  # noqa: F401  (--student: your slot_mapping, 5.3)
from nanoserve.kv.paged_attention import DECODE_GROUP, PagedKVCache, num_blocks_for_budget  # noqa: F401  (given)
from nanoserve.kv.paged_attention import AttentionMetadata as ReferenceAttentionMetadata
from nanoserve.model.attention import causal_mask  # noqa: F401  (chapter 01's (T, S) additive mask with offset)


class AttentionMetadata(ReferenceAttentionMetadata):
    """The fields are given (slot_mapping, block_tables, seq_lens, cu_seqlens_q: see the reference)."""

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int) -> "AttentionMetadata":
        """Exercise 5.3. One step's metadata from the block manager's integers: sequence i computes positions
        [seq_lens[i] - query_lens[i], seq_lens[i]).

        Return cls(slot_mapping, block_tables, seq_lens, cu_seqlens_q), all torch.long tensors:
            slot_mapping  (num_tokens,)  the slots of every sequence's new positions, sequence after sequence
            block_tables  (num_seqs, max_blocks)  each table padded on the right with block 0
            seq_lens      (num_seqs,)
            cu_seqlens_q  (num_seqs + 1,)  0, then the running sum of query_lens
        Raise ValueError if the three lists differ in length, or (mentioning "query_len") if a query_len is
        not in [1, seq_len].

        >>> m = AttentionMetadata.build([[3], [0, 2]], seq_lens=[3, 6], query_lens=[3, 1], block_size=4)
        >>> m.slot_mapping.tolist(), m.block_tables.tolist(), m.cu_seqlens_q.tolist()
        ([12, 13, 14, 9], [[3, 0], [0, 2]], [0, 3, 4])
        """
        raise NotImplementedError("Exercise 5.3: build the step's slot mapping, padded tables and cu_seqlens_q")


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Exercise 5.5 (the checkpoint). One sequence's keys (or values) from one layer's pool, dense and in
    position order.

    cache (Hkv, num_blocks, block_size, D), block_table (>= cdiv(seq_len, block_size),) long -> (Hkv, seq_len, D):
    position p is row p % block_size of block block_table[p // block_size]; the rows past seq_len in the last
    block, and any table entries past the blocks seq_len needs, are not returned. The engine calls this in
    every layer for every prefill: no Python loop over positions.

        cache = torch.arange(6.).view(1, 3, 2, 1)      1 kv head, 3 blocks of 2 slots, D = 1
        gather_kv(cache, torch.tensor([2, 0]), 3)    -> [[[4.], [5.], [0.]]]   (block 2, then block 0's first)
    """
    raise NotImplementedError("Exercise 5.5: gather one sequence's K or V through its block table")


def attend_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exercise 5.5. One sequence's T queries q (T, H, D) — the last T of its seq_len positions — against
    its K/V in the pool (gather_kv). Returns (T, H, D).

    q is in the pool's dtype (PagedAttention converted it). mask: the (T, seq_len) additive causal mask
    with its offset (causal_mask(T, seq_len), in the pool's dtype and on its device), or None for a whole
    prompt (T == seq_len), which must be causal all the same: query t sees positions 0 .. t. Query head h reads kv head
    h // (H // Hkv); K/V are not repeated per query head.

        T = 2 queries of a seq_len = 5 sequence are its positions 3 and 4: the first sees positions 0..3,
        the second 0..4.
    """
    raise NotImplementedError("Exercise 5.5: attend one sequence's queries to its gathered K/V")


class PagedAttention:
    """The AttentionFn of one step: attn(layer_idx, q (N, H, D), k, v (N, Hkv, D)) -> (N, H, D)."""

    def __init__(self, cache: PagedKVCache, metadata: ReferenceAttentionMetadata, batch_decodes: bool = True):
        """Exercise 5.5. Work out once per step what every layer reuses: keep cache and metadata, and split
        the sequences into
          - self.decode_groups: with batch_decodes, the sequences with one query, sorted by seq_len, in
            groups of DECODE_GROUP, each a DecodeGroup(cache, metadata, its sequence indices) (exercise 5.6:
            the reference's until you write yours);
          - the rest (all of them without batch_decodes), one at a time: where its queries are in the flat
            batch, its seq_len, its block table cut to cdiv(seq_len, block_size) blocks, and its mask (None
            for a whole prompt, causal_mask(T, seq_len) in the cache's dtype and on its device for a chunk on
            a prefix).
        """
        raise NotImplementedError("Exercise 5.5: plan the step (decode groups, and the sequences one at a time)")

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exercise 5.5. Layer layer_idx's attention for the whole flat batch: q (N, H, D), k, v (N, Hkv, D)
        -> (N, H, D). q, k, v come in the model's dtype, which may differ from the pool's (serve's default pool is
        bf16, and q, k, v may be float32): store and attend in the pool's dtype, return the output in q's.
        Afterwards the layer's pool holds this step's k, v at the metadata's slot_mapping, and
        row t of the output is token t's query attended over its own sequence's positions up to its own — this
        step's new tokens included, nobody else's. Each row is computed once: by the decode group that holds
        it (DecodeGroup, 5.6) or by attend_sequence."""
        raise NotImplementedError("Exercise 5.5: store the new K/V, then attend every sequence")


class DecodeGroup:
    """Decoding sequences (one query each) attended all at once: one padded gather, one batched attention call."""

    def __init__(self, cache: PagedKVCache, metadata: ReferenceAttentionMetadata, seqs: list[int]):
        """Exercise 5.6. The Sd decoding sequences `seqs` (indices into the metadata, one query each, any
        order), built once per step; attend then runs in every layer, so whatever does not depend on the
        layer (which blocks to read, what to hide) is worked out here, once, in the pool's dtype (a gather
        buffer of float32 cannot take a bf16 pool's rows).

        self.tokens: a long tensor (Sd,), each sequence's query row in the flat batch, in the order of seqs.

            tables [[3, 4], [1], [5, 6, 7]], seq_lens [4, 2, 5], query_lens [1, 2, 1]   (cu_seqlens_q [0, 1, 3, 4])
            DecodeGroup(cache, meta, [2, 0]).tokens.tolist()  ->  [3, 0]
        """
        raise NotImplementedError("Exercise 5.6: work out the group's gather and what it must hide, once per step")

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Exercise 5.6. One query per sequence, all sequences at once: q (Sd, H, D), row i the query of
        seqs[i], in the pool's dtype, against one layer's pool -> (Sd, H, D) in that dtype. Row i equals plain
        attention of that query over its sequence's seq_len positions, read through its block table, and over
        nothing else: the sequences' contexts differ in length, and whatever a shorter one's batch is padded
        with (another sequence's block, garbage) gets no weight. One gather for K and one for V serve the
        whole group, whatever Sd is: no Python loop over the sequences.

            seq_lens [3, 6], block_size 4: sequence 0 reads its 3 positions (1 block), sequence 1 its 6 (2 blocks)
        """
        raise NotImplementedError("Exercise 5.6: gather the group's blocks, attend with the padding mask")
