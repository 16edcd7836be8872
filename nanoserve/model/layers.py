"""Chapter 02 — the two small layers around attention: RMSNorm and the SwiGLU MLP."""

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with rms(x) = sqrt(mean(x²) + eps).

    Unlike LayerNorm it neither subtracts the mean nor adds a bias: cheaper, and it works as well.
    The statistic is taken in float32 whatever the input dtype, because mean(x²) of a bf16
    vector loses too many bits.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). The gate decides, per feature, how much of `up` passes."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
