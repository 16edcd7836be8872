"""Exercise 01 — causal attention with grouped-query heads.

Your version of nanoserve/model/attention.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=01`.
Shapes: B batch, T queries, S keys (S >= T), H query heads, Hkv key/value heads, D head_dim.
"""

import math

import torch


def causal_mask(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """Exercise 1.1. Additive mask (T, S): 0.0 where query i may attend key j, -inf where not.

    The queries are the LAST num_queries of num_keys positions (a KV cache holds the earlier
    ones), so query i sits at position num_keys - num_queries + i and sees keys 0 .. that position.
    Raise ValueError (mentioning "<num_queries> queries") if num_queries > num_keys.

    >>> causal_mask(2, 3)
    tensor([[0., 0., -inf],
            [0., 0., 0.]])
    """
    raise NotImplementedError("Exercise 1.1: build the additive causal mask with the cache offset")


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Exercise 1.2. (B, T, num_heads * D) -> (B, num_heads, T, D); head h owns columns h*D:(h+1)*D."""
    raise NotImplementedError("Exercise 1.2: split the last axis into heads and move heads before time")


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Exercise 1.2. (B, H, T, D) -> (B, T, H * D): the inverse of split_heads."""
    raise NotImplementedError("Exercise 1.2: move heads back after time and flatten them")


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Exercise 1.2. Grouped-query attention: (B, Hkv, S, D) -> (B, Hkv * num_groups, S, D),
    where output head h is a copy of input head h // num_groups."""
    raise NotImplementedError("Exercise 1.2: repeat each K/V head for its group of query heads")


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """Exercise 1.3. softmax(Q Kᵀ / √D + mask) V with grouped-query heads.

    q: (B, H, T, D), k and v: (B, Hkv, S, D), H a multiple of Hkv, T <= S. Returns (B, H, T, D).
    - Raise ValueError naming the shapes (e.g. "(1, 4, 3, 8)") if they do not fit together.
    - Subtract each row's max before exp(): the result is the same, and exp() cannot overflow.
    - Write the softmax yourself (no F.softmax / F.scaled_dot_product_attention).
    """
    raise NotImplementedError("Exercise 1.3: scores, mask, stable softmax, weighted sum of values")
