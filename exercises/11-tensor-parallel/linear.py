"""Exercise 11 — ColumnParallelLinear and RowParallelLinear (mirrors nanoserve/distributed/linear.py).

A bias-free Linear y = x · Wᵀ with W of shape (out, in), split over `tp.size` ranks; `tp` has `.rank`,
`.size` and `.all_reduce(x)` (in the one-process tests a fake that returns x unchanged, for real
torch.distributed's sum over the ranks). Read chapter 11 first. Grade with `make grade CH=11`.
"""

import torch
from torch import nn

from nanoserve.model.layers import linear


class ColumnParallelLinear(nn.Module):
    """Output features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out)."""

    def __init__(self, in_features: int, out_features: int, tp, num_shards: int | None = None,
                 shard_index: int | None = None):
        super().__init__()
        # Exercise 11.1: the slice is shard `shard_index` of `num_shards` equal ones (defaults: tp.rank of tp.size).
        # Set self.in_features, self.out_features, self.shard_dim (0: rows of W), self.shard_size,
        # self.shard_offset, and self.weight = nn.Parameter(torch.empty(shard_size, in_features)).
        # A ValueError if out_features does not split into num_shards.
        raise NotImplementedError("Exercise 11.1: ColumnParallelLinear.__init__")

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full (out, in) weight into self.weight."""
        raise NotImplementedError("Exercise 11.1: ColumnParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out/n)
        raise NotImplementedError("Exercise 11.1: ColumnParallelLinear.forward (use `linear`)")


class RowParallelLinear(nn.Module):
    """Input features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out), then all_reduce."""

    def __init__(self, in_features: int, out_features: int, tp):
        super().__init__()
        # Exercise 11.2: keep tp; shard_dim 1 (columns of W); shard_size = in / tp.size; shard_offset;
        # self.weight = nn.Parameter(torch.empty(out_features, shard_size)). A ValueError if in does not split.
        raise NotImplementedError("Exercise 11.2: RowParallelLinear.__init__")

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's columns of the full (out, in) weight into self.weight."""
        raise NotImplementedError("Exercise 11.2: RowParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in/n) -> (N, out), summed over the ranks
        raise NotImplementedError("Exercise 11.2: RowParallelLinear.forward (a partial product, then tp.all_reduce)")
