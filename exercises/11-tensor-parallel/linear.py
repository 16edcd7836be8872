"""Exercises 11.2 and 11.3 — ColumnParallelLinear and RowParallelLinear (mirror nanoserve/distributed/linear.py).

A bias-free Linear y = x · Wᵀ with W of shape (out, in), split over `tp.size` ranks; `tp` has `.rank`,
`.size` and `.all_reduce(x)` (in the one-process tests a fake that returns x unchanged, for real
torch.distributed's sum over the ranks). Each class knows which slice of W it holds (shard_dim,
shard_offset, shard_size), so that the GGUF loader reads only that slice from the file, and
`weight_loader(full)` copies it out of a full weight. Read chapter 11 first. Each rung is graded alone:
`make grade CH=11 EX=11.2` (the reference stands in for the other class).
"""

import torch
from torch import nn

from nanoserve.model.layers import linear  # noqa: F401  (x · Wᵀ, as everywhere in the course)


class ColumnParallelLinear(nn.Module):
    """Output features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out)."""

    def __init__(self, in_features: int, out_features: int, tp, num_shards: int | None = None,
                 shard_index: int | None = None):
        """Exercise 11.2. This rank's slice is shard `shard_index` of `num_shards` equal ones (by default
        this rank's of tp.size; replicated KV heads pass fewer shards, so several ranks hold one slice).

        Sets in_features, out_features, shard_dim (the dim of W that is split), shard_offset, shard_size and
        weight, an uninitialised nn.Parameter of this rank's shape. ValueError (naming the counts) when the
        output features do not split into num_shards. Example: ColumnParallelLinear(4, 6, tp) on rank 1 of 2:
        shard_dim 0, shard_offset 3, shard_size 3, weight (3, 4) — rows 3..5 of W.
        """
        super().__init__()
        raise NotImplementedError("Exercise 11.2: ColumnParallelLinear.__init__")

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Exercise 11.2. Copy this rank's slice of the full (out, in) weight into self.weight."""
        raise NotImplementedError("Exercise 11.2: ColumnParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Exercise 11.2. (N, in) -> (N, out / num_shards): this rank's output features. No communication."""
        raise NotImplementedError("Exercise 11.2: ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """Input features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out); the ranks'
    results meet in one all_reduce."""

    def __init__(self, in_features: int, out_features: int, tp):
        """Exercise 11.3. This rank's slice of the input features, 1/tp.size of them. Sets tp, in_features,
        out_features, shard_dim, shard_offset, shard_size and weight (uninitialised, this rank's shape).
        ValueError (naming the counts) when the input features do not split over the ranks. Example:
        RowParallelLinear(4, 2, tp) on rank 1 of 2: shard_dim 1, shard_offset 2, shard_size 2, weight (2, 2)
        — columns 2..3 of W."""
        super().__init__()
        raise NotImplementedError("Exercise 11.3: RowParallelLinear.__init__")

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Exercise 11.3. Copy this rank's slice of the full (out, in) weight into self.weight."""
        raise NotImplementedError("Exercise 11.3: RowParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Exercise 11.3. (N, in / n), this rank's slice of the input features (as a column-parallel layer
        leaves it) -> (N, out), the whole product x · Wᵀ, the same on every rank. Example (chapter 11,
        section 2): W = [[1, 2, 3, 4], [5, 6, 7, 8]], x = [1, 1, 1, 1]; rank 1 holds [[3, 4], [7, 8]], gets
        x_1 = [1, 1], computes [7, 15]; rank 0 computes [3, 11]; both return [10, 26]."""
        raise NotImplementedError("Exercise 11.3: RowParallelLinear.forward")
