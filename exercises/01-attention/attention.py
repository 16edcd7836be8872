"""Exercise 01 — causal attention with grouped-query heads.

Your version of nanoserve/model/attention.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=01`.
Shapes: B batch, T queries, S keys (S >= T), H query heads, Hkv key/value heads, D head_dim.
"""

import math

import torch


def causal_mask(num_queries: int, num_keys: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exercise 1.1. Additive mask (T, S): 0.0 where query i may attend key j, -inf where not.

    The queries are the LAST num_queries of num_keys positions (a KV cache holds the earlier
    ones), so query i sits at position num_keys - num_queries + i and sees keys 0 .. that position.
    The mask is on `device` and of `dtype` (the scores' dtype: bf16 scores plus a bf16 mask stay bf16).
    Raise ValueError (mentioning "<num_queries> queries") if num_queries > num_keys.

    >>> causal_mask(2, 3)
    tensor([[0., 0., -inf],
            [0., 0., 0.]])
    """
    raise NotImplementedError("Exercise 1.1: build the additive causal mask with the cache offset")


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Exercise 1.2. (B, T, num_heads * D) -> (B, num_heads, T, D); head h owns columns h*D:(h+1)*D.

    Raise ValueError if the width is not a multiple of num_heads (a width of 7 and 3 heads, say).

    >>> split_heads(torch.arange(12.0).view(1, 2, 6), num_heads=3)[0, 1]   # head 1 of both tokens
    tensor([[2., 3.],
            [8., 9.]])
    """
    raise NotImplementedError("Exercise 1.2: split the last axis into heads and move heads before time")


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Exercise 1.2. (B, H, T, D) -> (B, T, H * D): the inverse of split_heads, so that
    merge_heads(split_heads(x, H)) equals x exactly, for any x of shape (B, T, H * D)."""
    raise NotImplementedError("Exercise 1.2: move heads back after time and flatten them")


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Exercise 1.2. Grouped-query attention: (B, Hkv, S, D) -> (B, Hkv * num_groups, S, D),
    where output head h is a copy of input head h // num_groups (num_groups = 1: x itself, or a copy).

    Example: 2 K/V heads [k0, k1] and num_groups = 3 give 6 heads [k0, k0, k0, k1, k1, k1].
    """
    raise NotImplementedError("Exercise 1.2: repeat each K/V head for its group of query heads")


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """Exercise 1.3. softmax(Q Kᵀ / √D + mask) V with grouped-query heads.

    q: (B, H, T, D), k and v: (B, Hkv, S, D), H a multiple of Hkv, T <= S. Returns (B, H, T, D) in q's
    dtype (bf16 in, bf16 out; float32 in, float32 out).
    - Query head h reads K/V head h // (H / Hkv). With causal=True the T queries are the last T of the S
      positions (causal_mask(T, S)); with causal=False every query sees every key.
    - Raise ValueError if the shapes do not fit together: q, k or v not 4-D, k and v of different shapes, a
      different B or D in q and k, H not a multiple of Hkv, or T > S. Its message names the shapes as tuples,
      in any order: q's and k's (e.g. "(1, 4, 3, 8)" and "(1, 3, 3, 8)"), and v's where it differs from k's.
    - Stay finite for any finite scores, however large (q·k of 360,000 included): equal scores, equal weights.
    - The point is to write the softmax yourself; the tests check only the numbers (against PyTorch's own
      F.scaled_dot_product_attention), so F.softmax would pass too.

    Example: one head, D = 1, q = [1, 2], k = [1, 0], v = [10, 20] (all (1, 1, 2, 1)), causal: query 0 sees
    only key 0 -> 10; query 1 has scores [2, 0] -> weights [0.881, 0.119] -> 11.19.
    """
    raise NotImplementedError("Exercise 1.3: scores, mask, stable softmax, weighted sum of values")
