"""Exercise 11.4 — the vocabulary split over ranks (mirrors nanoserve/distributed/vocab.py): the embedding
(ids -> vectors) and the LM head (vectors -> logits), one (V, hidden) matrix held in row slices.

`tp` has `.rank`, `.size`, `.all_reduce(x)` (the sum over the ranks, on every rank) and `.gather(x)` (rank 0
gets every rank's x side by side along the last dim, in rank order; the other ranks get None). Read chapter
11, section 2, first. Grade with `make grade CH=11 EX=11.4`.
"""

import torch
from torch import nn
from torch.nn import functional as F  # noqa: F401  (F.embedding)

from nanoserve.model.layers import linear  # noqa: F401  (x · Wᵀ, as everywhere in the course)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp):
        """Exercise 11.4. Rank r's rows of a (vocab_size, hidden_size) embedding: every rank holds the same
        number of rows, ceil(V / n), so the last ranks may hold padding rows (zeros) past the vocabulary.

        Sets tp, vocab_size, shard_dim (0), shard_offset (the first vocabulary row this rank holds),
        shard_size (the rows of the real vocabulary it holds: 0 for a rank that holds only padding) and
        weight, a (ceil(V / n), hidden) nn.Parameter of zeros. Example: V = 10 over 4 ranks holds 3 rows each;
        rank 3's shard_offset is 9, its shard_size 1.
        """
        super().__init__()
        raise NotImplementedError("Exercise 11.4: VocabParallelEmbedding.__init__")

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Exercise 11.4. Copy this rank's rows of the full (V, hidden) matrix; the padding rows are zero."""
        raise NotImplementedError("Exercise 11.4: VocabParallelEmbedding.weight_loader")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Exercise 11.4. (N,) ids -> (N, hidden), the same on every rank: the embedding of each id, although
        each rank holds only its rows. An id of another rank must not index this rank's table (out of range,
        or worse, a wrong row). One all_reduce."""
        raise NotImplementedError("Exercise 11.4: VocabParallelEmbedding.forward")


class ParallelLMHead(VocabParallelEmbedding):
    """The same rows of the same matrix (tied to the embedding in SmolLM2), read the other way."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Exercise 11.4. (N, hidden) -> (N, vocab_size) logits on rank 0 (exactly vocab_size columns, none
        of the padding), None on the other ranks. Rank 0 samples, so it needs the whole distribution."""
        raise NotImplementedError("Exercise 11.4: ParallelLMHead.forward")
