"""Chapter 11 — the vocabulary split across ranks: the embedding (ids -> vectors) and the LM head
(vectors -> logits). SmolLM2's is 49152 × 576 = 28.3 M weights, a fifth of the model.

Rank r holds rows [r·V/n, (r+1)·V/n) of the (V, hidden) matrix, V rounded up to a multiple of n (the
padding rows are zero and their logits are cut off): vocab 256 over 3 ranks is 86 + 86 + 84 (+ 2 padding).

    VocabParallelEmbedding: a rank looks up the ids that fall in its rows and writes zeros for the rest;
        an all_reduce sums the ranks' (N, hidden), and exactly one rank contributed each row.
    ParallelLMHead: each rank computes the logits of its slice of the vocabulary, (N, V/n), and rank 0
        GATHERS them into (N, V). We gather whole logits, as vLLM does, rather than each rank's argmax:
        temperature, top-k and top-p need the whole distribution, and rank 0 owns the sampling state
        (the seeded generators). The price: each other rank sends its N · V/n · 4 bytes per step, so rank 0
        receives (n − 1)/n of the N · V · 4 (SmolLM2 at TP 3: 131,072 B per sampled token); a greedy-only engine
        could send each rank's (max, argmax) instead, 16 bytes per rank and token.
"""

import torch
from torch import nn
from torch.nn import functional as F

from nanoserve.model.layers import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        per_rank = -(-vocab_size // tp.size)  # rows held, padding included
        self.shard_dim, self.shard_offset = 0, tp.rank * per_rank
        self.shard_size = max(0, min(per_rank, vocab_size - self.shard_offset))  # real rows of the vocabulary
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size))  # (V/n, hidden)

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full (V, hidden) matrix; the padding rows stay zero."""
        self.weight.data.zero_()
        # a slice, not narrow(): a rank of padding alone starts past the vocabulary (V = 5 over 4: rank 3 at row 6)
        self.weight.data[:self.shard_size] = full_weight[self.shard_offset:self.shard_offset + self.shard_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden)
        local = input_ids - self.shard_offset
        mine = (local >= 0) & (local < self.shard_size)
        x = F.embedding(local.masked_fill(~mine, 0), self.weight)  # (N, hidden), rows of other ranks wrong...
        x = x.masked_fill(~mine[:, None], 0.0)  # ...so zeroed: the all_reduce adds the owner's row to zeros
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """The same rows of the same (V, hidden) matrix (vLLM's class is also a VocabParallelEmbedding), read the
    other way: logits = hidden · Wᵀ for this rank's slice of the vocabulary; rank 0 gets all of them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # (N, hidden) -> (N, V) on rank 0, else None
        logits = self.tp.gather(linear(hidden, self.weight))  # (N, V/n) per rank -> (N, n · V/n) on rank 0
        return None if logits is None else logits[:, :self.vocab_size]
