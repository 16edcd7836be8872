"""Chapter 07 — the online softmax (plain torch) equals the full softmax, and its running max and sum
after each tile are the max and the sum of exp(score - max) over the keys seen so far (computed here
directly from the whole score matrix)."""

import pytest
import torch

from nanoserve.kernels.online_softmax import online_softmax_attention
from nanoserve.model.attention import causal_mask


def full_attention(q, k, v):
    """softmax(q·Kᵀ/√D + causal mask)·V in one go: the whole (T, S) score matrix at once."""
    scores = q @ k.T / q.shape[-1] ** 0.5 + causal_mask(q.shape[0], k.shape[0])
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("T, S, tile", [(1, 1, 4), (1, 37, 8), (5, 5, 2), (7, 40, 16), (16, 16, 64), (3, 50, 1)])
def test_online_equals_full_softmax(T, S, tile):
    torch.manual_seed(T * 100 + S)
    q, k, v = torch.randn(T, 16), torch.randn(S, 16), torch.randn(S, 16)
    assert (online_softmax_attention(q, k, v, tile) - full_attention(q, k, v)).abs().max() < 1e-5


def test_large_scores_do_not_overflow():
    """exp(100) overflows nothing because every exponent is relative to the running max."""
    q, k, v = torch.full((2, 4), 20.0), torch.randn(12, 4) * 10, torch.randn(12, 4)
    out = online_softmax_attention(q, k, v, tile_size=4)
    assert torch.isfinite(out).all() and (out - full_attention(q, k, v)).abs().max() < 1e-5


def test_running_max_and_sum_after_every_tile():
    torch.manual_seed(0)
    T, S, tile = 3, 10, 4
    q, k, v = torch.randn(T, 8), torch.randn(S, 8), torch.randn(S, 8)
    scores = q @ k.T / 8**0.5 + causal_mask(T, S)  # (T, S)
    seen = []
    online_softmax_attention(q, k, v, tile, on_tile=lambda i, m, l: seen.append((i, m.clone(), l.clone())))
    assert [i for i, _, _ in seen] == [0, 1, 2]  # ceil(10 / 4) tiles
    for i, m, l in seen:
        upto = scores[:, : min((i + 1) * tile, S)]
        assert torch.allclose(m, upto.max(-1).values)
        assert torch.allclose(l, torch.exp(upto - m[:, None]).sum(-1))
