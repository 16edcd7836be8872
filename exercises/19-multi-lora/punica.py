"""Exercises 19.1 and 19.2 — the batched LoRA product: every token adds the update of its own adapter.

This file mirrors nanoserve/lora/punica.py. Under --student 19 the LoRA layers call your sgmv (prefill chunks and
mixed steps) and bgmv (steps where every sequence decodes one token). The layout, for one fused projection of
S slices (qkv_proj: S = 3, [q, k, v] rows; o_proj: S = 1) and R = max_lora_rank:

    a: (num_slots, S·R, in)    slice s's A in rows [s·R, (s+1)·R), zero-padded past the adapter's rank
    b: (num_slots, out, R)     slice s's scale·B in the rows of slice s's output, slice_bounds(slices)[s]
    slot 0 holds zeros: the base model

Graded with `make grade CH=19`. README.md has the questions to answer first.
"""

import torch

from nanoserve.lora.punica import slice_bounds  # [576, 192, 192] -> [(0, 576), (576, 768), (768, 960)]


def bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
         slices: list[int]) -> torch.Tensor:
    """Exercise 19.2: the LoRA update of each token, each with its own slot's weights.

    x: (N, in) float32; token_slots: (N,) long, the slot of each row; returns (N, out) float32 whose row t, in the
    output columns of slice s, is b[slot, rows_s] · (a[slot, s·R:(s+1)·R] · x[t]) with slot = token_slots[t].
    A slot-0 row comes out all zeros. Gather per token, no Python loop over tokens (a loop over the S slices is
    fine). Example: two tokens of slots [1, 0] -> row 0 is adapter 1's update, row 1 is zeros.
    """
    raise NotImplementedError("Exercise 19.2: write bgmv (see its docstring and README.md)")


def sgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: list[tuple[int, int, int]],
         slices: list[int]) -> torch.Tensor:
    """Exercise 19.1: the same update, segment by segment: the LoRA linear of one adapter on a run of tokens.

    segments: (start, end, slot) covering x's rows [0, N) in order; rows of a slot-0 segment are zeros. For a
    segment, the rows x[start:end] (n, in) go through a[slot] then, per slice, b[slot, rows_s]: two matrix
    products, no per-token copy of the weights. Returns (N, out) float32.
    Example: segments [(0, 5, 2)] -> x · A₂ᵀ · B₂ᵀ per slice, for a 5-token prefill of adapter 2's request.
    """
    raise NotImplementedError("Exercise 19.1: write sgmv (see its docstring and README.md)")
