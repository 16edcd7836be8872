"""Chapter 02 — the small layers around attention: Linear, RMSNorm and the SwiGLU MLP."""

import torch
from torch import nn
from torch.nn import functional as F

from nanoserve.model.stacked import stack_parts


# Up to this many tokens a product is computed "swap AB" (see `linear`): all decode steps of the
# default engine (64 running sequences at most), not the prefill chunks. Chosen from one run of
# `bench linear` on the course CPU with the projections still unfused (swapped 2.35x faster at 4 tokens,
# 1.20x at 16, 1.12x at 64); other runs there gave 1.1-1.5x at 16 but 1.0-1.35x at 64, and 1.00x in the
# engine's decode steps of 17-64 sequences: at 64 tokens the gain was within the noise. Not re-derived for
# the fused qkv_proj and gate_up_proj the model runs now: three runs on a shared 2-core AMD EPYC (chapter
# 06, section 8; F.linear first in every round, before bench linear alternated the order) gave 1.26-1.39x at 4 tokens, 0.77-1.13x at 1 and 16 (noise) and 0.80-1.00x at 64 (no gain,
# perhaps a loss). Kept, as no quiet measurement of the fused shapes supports another value; `bench linear`
# on the CPU at hand says where its crossover is.
SWAP_AB_MAX_TOKENS = 64


def swap_ab(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ computed as (W · xᵀ)ᵀ. x: (num_tokens, in), weight: (out, in) -> (num_tokens, out)."""
    y = torch.mm(weight, x.t())  # (out, num_tokens)
    return y.t().contiguous()  # the layout F.linear returns


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x · Wᵀ (x: (..., in), weight: (out, in)); small batches go to BLAS with the operands swapped.

    F.linear(x, W) and swap_ab(x, W) are the same product; only the order in which the operands go to
    the matrix-multiply routine differs. torch's CPU build hands both to MKL's sgemm, with the roles
    swapped (run with MKL_VERBOSE=1 to see the calls):

        F.linear(x, W)   SGEMM(T,N, m=out,    n=tokens, k=in)   the weight is operand A
        swap_ab(x, W)    SGEMM(T,N, m=tokens, n=out,    k=in)   the tokens are operand A

    A decode step has few tokens (one per running sequence) and wide weights, and MKL may pick a better
    kernel for the swapped call: `python -m nanoserve bench linear` times both over all of the model's
    matrices. At 4 tokens the swapped call was faster in every run chapter 06 quotes; from 16 tokens on the
    difference is within the noise, and from 256 tokens on (prefill) it is usually slower (SWAP_AB_MAX_TOKENS
    above says which runs). GPU GEMM kernels play the same trick on decode-sized batches under the same
    name (vLLM's CUTLASS FP8 GEMMs have swap-AB configurations for small batches), so that the tiny
    dimension lands where the kernel's tiles can afford it. Which form wins is a property of the library,
    the hardware and the shapes: measure before you copy it.
    """
    x2 = x.reshape(-1, x.shape[-1])  # (num_tokens, in)
    if x2.shape[0] > SWAP_AB_MAX_TOKENS:
        return F.linear(x, weight)
    return swap_ab(x2, weight).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """A bias-free nn.Linear (same `weight`, shape (out, in)) whose product is `linear` above."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight)


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
    """SwiGLU: down(silu(gate(x)) * up(x)). The gate decides, per feature, how much of `up` passes.

    gate and up read the same x, so they are one product (`gate_up_proj`, stacked rows [gate | up]: see
    nanoserve/model/stacked.py); the state_dict still names them gate_proj and up_proj, as HF does.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        stack_parts(self, "gate_up_proj", lambda w: [w.shape[0] // 2] * 2)  # a TP shard: half of its rows each

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., intermediate) each
        return self.down_proj(F.silu(gate) * up)
