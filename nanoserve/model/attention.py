"""Chapter 01 — attention, written out.

    out = softmax(Q Kᵀ / √d + mask) V

Shapes follow one convention throughout the course:

    B  batch size            T  query tokens       S  key/value tokens (S >= T)
    H  query heads           Hkv key/value heads   D  head_dim

A worked example (one sequence, T = S = 3, no batching):

    scores = Q Kᵀ / √D                 # (H, 3, 3)
    scores + causal_mask(3, 3)         # upper triangle becomes -inf
    softmax over the last axis         # row i spreads its weight over keys 0..i
    @ V                                # (H, 3, D)

With a KV cache the queries are the *last* T of S positions (decode: T = 1),
so query i may see keys 0 .. (S - T + i): `causal_mask` takes that offset into account.
"""

import math

import torch


def causal_mask(num_queries: int, num_keys: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask (T, S): 0 where query i may attend key j, -inf where it may not.

    The queries are the last `num_queries` positions of `num_keys`, so
    query i sits at absolute position `num_keys - num_queries + i`.
    `dtype` is the scores' dtype: a float32 mask added to bf16 scores would promote them to float32.

    >>> causal_mask(2, 3)
    tensor([[0., 0., -inf],
            [0., 0., 0.]])
    """
    if num_queries > num_keys:
        raise ValueError(f"causal_mask: {num_queries} queries cannot be the last positions of only {num_keys} keys")
    offset = num_keys - num_queries
    q_pos = torch.arange(num_queries, device=device)[:, None] + offset  # (T, 1)
    k_pos = torch.arange(num_keys, device=device)[None, :]  # (1, S)
    mask = torch.zeros(num_queries, num_keys, device=device, dtype=dtype)
    return mask.masked_fill(k_pos > q_pos, float("-inf"))


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, num_heads * D) -> (B, num_heads, T, D)"""
    B, T, width = x.shape
    if width % num_heads:
        raise ValueError(f"split_heads: width {width} is not divisible by num_heads={num_heads}")
    return x.view(B, T, num_heads, width // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D), the inverse of `split_heads`."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves `num_groups` query heads.

    (B, Hkv, S, D) -> (B, Hkv * num_groups, S, D); query head h reads K/V head h // num_groups.
    Only the *cache* is small; the math is ordinary multi-head attention.
    """
    if num_groups == 1:
        return x
    B, Hkv, S, D = x.shape
    return x[:, :, None].expand(B, Hkv, num_groups, S, D).reshape(B, Hkv * num_groups, S, D)


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """softmax(Q Kᵀ / √D + mask) V with grouped-query heads.

    q: (B, H, T, D)    k, v: (B, Hkv, S, D) with H a multiple of Hkv and T <= S.
    Returns (B, H, T, D).
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"attention expects q (B, H, T, D) and k, v (B, Hkv, S, D) of equal shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D or H % Hkv or T > S:
        raise ValueError(
            f"attention shapes do not fit: q {tuple(q.shape)} vs k/v {tuple(k.shape)} "
            f"(need the same B and D, H divisible by Hkv, and T <= S)"
        )
    k = repeat_kv(k, H // Hkv)  # (B, H, S, D)
    v = repeat_kv(v, H // Hkv)  # (B, H, S, D)

    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, S)
    if causal:
        scores = scores + causal_mask(T, S, device=q.device, dtype=scores.dtype)  # bf16 scores stay bf16
    # Numerically stable softmax: subtracting the row max changes nothing mathematically
    # (it cancels in the ratio) but keeps exp() from overflowing.
    scores = scores - scores.amax(dim=-1, keepdim=True)
    weights = scores.exp()
    weights = weights / weights.sum(dim=-1, keepdim=True)  # (B, H, T, S)
    return weights @ v  # (B, H, T, D)
