"""Exercise 2.1 — RMSNorm. Your version of the RMSNorm in nanoserve/model/layers.py."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x², last axis) + eps) * weight.

    Keep the `weight` parameter as created here (transformers' LlamaRMSNorm has the same one, and the
    tests load weights into it). Compute the statistic in float32 and cast back to x's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden)
        raise NotImplementedError("Exercise 2.1: normalise by the root mean square, then scale by weight")
