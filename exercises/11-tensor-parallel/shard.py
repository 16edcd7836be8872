"""Exercise 11.1 — which heads a rank holds (mirrors `split_heads` of nanoserve/distributed/shard.py).

Everything else of shard.py (the sharded Llama, its slice of the GGUF) is given. Read chapter 11, section 3,
first. Grade with `make grade CH=11 EX=11.1`.
"""

from nanoserve.distributed.shard import HeadSplit  # noqa: F401  (given: the result type)
from nanoserve.model.config import LlamaConfig


def split_heads(config: LlamaConfig, tp_size: int) -> HeadSplit:
    """Exercise 11.1. The heads one rank of `tp_size` holds: HeadSplit(num_heads, num_kv_heads, num_kv_shards)
    — query heads per rank, KV heads per rank, and how many distinct KV slices the ranks hold between them
    (HeadSplit.kv_shard(rank, tp_size) then says which one a rank holds).

    Attention splits by whole heads, and each rank must hold the KV heads its query heads read (GQA: a group
    of H / Hkv query heads reads one KV head). vLLM's rule: shard the KV heads when they divide over the
    ranks; when there are fewer KV heads than ranks and the ranks divide over them, replicate each KV head on
    several ranks; anything else is a ValueError that names tensor_parallel_size, num_key_value_heads and
    num_attention_heads (so does a tp_size that does not divide the query heads). A tp_size below 1 is a
    ValueError that names tensor_parallel_size.

    Examples (SmolLM2: 9 query, 3 KV heads):  tp 1 -> (9, 3, 1);  tp 3 -> (3, 1, 3);  tp 9 -> (1, 1, 3);
    tp 2 -> ValueError.  Llama-3-8B (32 / 8) at tp 16: one KV head per rank, each on 2 ranks.
    """
    raise NotImplementedError("Exercise 11.1: heads per rank, KV heads sharded or replicated (vLLM's rule)")
