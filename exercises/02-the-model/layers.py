"""Exercise 2.1 — RMSNorm. Your version of the RMSNorm in nanoserve/model/layers.py."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Exercise 2.1. y = x / sqrt(mean(x², last axis) + eps) * weight, for x of shape (..., hidden).

    Each row (each token) is normalised on its own: only the last axis is averaged. Keep the `weight`
    parameter as created here (transformers' LlamaRMSNorm has the same one, and the tests load weights into
    it). y has x's shape. The statistic is taken in float32 whatever x's dtype; the normalised x is cast back to
    x's dtype before `weight` multiplies it, so when `weight` has x's dtype (a model in float16 or bf16), so has y.
    (A float32 weight on a bf16 x gives a float32 y, by torch's type promotion, as in transformers' LlamaRMSNorm.)

    Example: x = [[3, 4]], eps = 0, weight = [2, -1]: mean(x²) = 12.5, so y = [[6, -4]] / √12.5 = [[1.697, -1.131]].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden)
        raise NotImplementedError("Exercise 2.1: normalise by the root mean square, then scale by weight")
