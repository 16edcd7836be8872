"""Chapter 07 — the online softmax: attention over keys one tile at a time, never the whole score row.

softmax(s)_j = exp(s_j - m) / l with m = max_j s_j and l = sum_j exp(s_j - m). A kernel that reads keys
tile by tile does not know the final m until the last tile, so it keeps, per query row,

    m    the largest score seen so far
    l    sum of exp(score - m) over the keys seen so far
    acc  sum of exp(score - m) · v over the keys seen so far   (D numbers)

and when a tile raises the max from m to m', everything summed so far was scaled by exp(-m) instead of
exp(-m'): multiply l and acc by alpha = exp(m - m') (<= 1) before adding the tile. After the last tile,
out = acc / l — exactly softmax(q·Kᵀ/√D)·V, with one (T, TILE) block of scores alive at a time.

    >>> q, k, v = torch.randn(3, 8), torch.randn(10, 8), torch.randn(10, 8)
    >>> full = torch.softmax(q @ k.T / 8 ** 0.5 + causal_mask(3, 10), -1) @ v
    >>> torch.allclose(online_softmax_attention(q, k, v, tile_size=4), full, atol=1e-6)
    True

The Triton kernel (`triton_paged_attention.py`, `online_softmax_step`) runs this very loop.
"""

import torch

from nanoserve.model.attention import causal_mask


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_size: int = 16,
                             on_tile=None) -> torch.Tensor:
    """q (T, D), k/v (S, D) -> (T, D): causal attention (the T queries are the last T of S positions),
    keys visited tile_size at a time. on_tile(tile_index, m, l), if given, sees the running state after each tile."""
    T, D = q.shape
    S = k.shape[0]
    mask = causal_mask(T, S)  # (T, S) additive: 0 where query t may see key s, -inf where not
    m = torch.full((T,), float("-inf"))  # running max, per query row
    l = torch.zeros(T)  # running sum of exp(score - m)
    acc = torch.zeros(T, D)  # running sum of exp(score - m) · v
    for i, start in enumerate(range(0, S, tile_size)):
        end = min(start + tile_size, S)
        scores = q @ k[start:end].T / D**0.5 + mask[:, start:end]  # (T, tile)
        m_new = torch.maximum(m, scores.max(-1).values)  # finite from tile 0 on: key 0 is visible to every row
        alpha = torch.exp(m - m_new)  # rescale what was summed under the old max
        p = torch.exp(scores - m_new[:, None])  # (T, tile), 0 where masked
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + p @ v[start:end]
        m = m_new
        if on_tile is not None:
            on_tile(i, m, l)
    return acc / l[:, None]
