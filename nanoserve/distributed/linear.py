"""Chapter 11 — the two ways to split a Linear y = x · Wᵀ (W: (out, in)) across tp_size ranks (Megatron-LM).

    ColumnParallelLinear: rank r holds ROWS of W, i.e. a slice of the OUTPUT features
        W_r = W[r·out/n : (r+1)·out/n]           y_r = x · W_rᵀ      (N, out/n) — no communication
    RowParallelLinear: rank r holds COLUMNS of W, i.e. a slice of the INPUT features
        W_r = W[:, r·in/n : (r+1)·in/n]          y = Σ_r x_r · W_rᵀ  (N, out) — one all_reduce

A column-parallel layer leaves each rank with a slice of the features; a row-parallel layer takes exactly
such a slice as its input. So the MLP is column (gate, up) → SiLU · (elementwise, per slice) → row (down),
and attention is column (q, k, v: whole heads per rank) → attention per head → row (o_proj): one
all_reduce per sub-block, two per decoder layer. Worked example, in = 4, out = 2, n = 2:

    W = [[1, 2, 3, 4],      row-parallel: W_0 = [[1, 2],   W_1 = [[3, 4],
         [5, 6, 7, 8]]                           [5, 6]]          [7, 8]]
    x = [1, 1, 1, 1]        x_0 = [1, 1] -> [3, 11],   x_1 = [1, 1] -> [7, 15];   sum = [10, 26] = x · Wᵀ

`weight_loader(full)` copies this rank's slice out of a full weight; the GGUF loader instead reads only
the slice (shard_dim, shard_offset, shard_size) from the file. Each rank holds 1/n of the weight bytes.
"""

import torch
from torch import nn

from nanoserve.model.layers import linear


class ColumnParallelLinear(nn.Module):
    """Output features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out).

    The slice is shard `shard_index` of `num_shards` equal ones (default: this rank's of tp_size). KV
    heads replicated over ranks (more ranks than KV heads) pass num_shards = num_kv_heads instead.
    """

    def __init__(self, in_features: int, out_features: int, tp, num_shards: int | None = None,
                 shard_index: int | None = None):
        nn.Module.__init__(self)  # not super(): the grader puts this method into the learner's class (exercise 11.2)
        num_shards = tp.size if num_shards is None else num_shards
        shard_index = tp.rank if shard_index is None else shard_index
        if out_features % num_shards:
            raise ValueError(f"ColumnParallelLinear: {out_features} output features do not split into {num_shards} shards")
        self.in_features, self.out_features = in_features, out_features
        self.shard_dim, self.shard_size = 0, out_features // num_shards
        self.shard_offset = shard_index * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, in_features))  # (out/n, in)

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full (out, in) weight."""
        self.weight.data.copy_(full_weight.narrow(self.shard_dim, self.shard_offset, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out/n): this rank's features
        return linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Input features [shard_offset, shard_offset + shard_size) of a bias-free Linear(in, out); the ranks'
    partial products are summed by an all_reduce, so every rank gets the whole (N, out) output."""

    def __init__(self, in_features: int, out_features: int, tp):
        nn.Module.__init__(self)  # not super(): the grader puts this method into the learner's class (exercise 11.3)
        if in_features % tp.size:
            raise ValueError(f"RowParallelLinear: {in_features} input features do not split over {tp.size} ranks")
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.shard_dim, self.shard_size = 1, in_features // tp.size
        self.shard_offset = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(out_features, self.shard_size))  # (out, in/n)

    def weight_loader(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's columns of the full (out, in) weight."""
        self.weight.data.copy_(full_weight.narrow(self.shard_dim, self.shard_offset, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in/n) this rank's features -> (N, out), summed
        return self.tp.all_reduce(linear(x, self.weight))


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel layers over the same input in ONE weight (vLLM's name): this rank's rows of
    each part, stacked. gate_up_proj is [gate rows of this rank | up rows of this rank], so the MLP's
    `chunk(2)` still finds gate and up (nanoserve/model/stacked.py). Worked example, parts (4, 4), n = 2,
    rank 1: rows 2-3 of gate then rows 2-3 of up, a (4, in) weight.

    Each part's slice is a ColumnParallelLinear's (`column`: the reference class or the learner's, built on
    the meta device, so it holds no memory): `part_slices[i]` = (shard_offset, shard_size) in part i.
    """

    def __init__(self, in_features: int, output_sizes: list[int], tp, column=ColumnParallelLinear,
                 shards: list[tuple[int | None, int | None]] | None = None):
        super().__init__()
        shards = shards or [(None, None)] * len(output_sizes)
        with torch.device("meta"):
            parts = [column(in_features, size, tp, n, i) for size, (n, i) in zip(output_sizes, shards)]
        self.in_features, self.shard_dim = in_features, 0
        self.part_slices = [(p.shard_offset, p.shard_size) for p in parts]
        self.output_sizes = [size for _, size in self.part_slices]  # this rank's rows of each part
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))  # (Σ out_i/n, in)

    def part_rows(self, shard_id: int) -> slice:
        """Where part `shard_id` lives in this rank's weight."""
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])

    def weight_loader(self, full_weight: torch.Tensor, shard_id: int) -> None:
        """Copy this rank's rows of part `shard_id`'s full (out_i, in) weight (vLLM's loaded_shard_id)."""
        offset, size = self.part_slices[shard_id]
        self.weight.data[self.part_rows(shard_id)] = full_weight.narrow(0, offset, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, Σ out_i/n)
        return linear(x, self.weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one column-parallel weight: this rank's query heads, then the k and v of its KV heads.
    The KV parts follow chapter 11's rule (split_heads in shard.py): sharded over the ranks, or replicated
    with `num_kv_shards` = Hkv slices (kv_shard: this rank's). SmolLM2 at TP 3: rows [q 192 | k 64 | v 64]."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, tp,
                 num_kv_shards: int | None = None, kv_shard: int | None = None, column=ColumnParallelLinear):
        kv = (num_kv_shards, kv_shard)
        super().__init__(hidden_size, [total_num_heads * head_dim] + [total_num_kv_heads * head_dim] * 2, tp,
                         column, [(None, None), kv, kv])
