"""Chapter 02 — the small layers around attention: Linear, RMSNorm and the SwiGLU MLP."""

import torch
from torch import nn
from torch.nn import functional as F

from nanoserve.model.stacked import stack_parts


# Up to this many tokens a product is computed "swap AB" (see `linear`): the decode steps of up to 4 running
# sequences. Derived from three runs of `OMP_NUM_THREADS=1 python -m nanoserve bench linear --tokens 1 4 8 16 32 64`
# and two of `--tokens 1 2 4 6 8 12 16` (--repeats 3, the two forms interleaved after a warm-up) on a 2-core AMD
# EPYC VM of the course whose CPU kind the runs did not record (Zen 4 or Zen 3), load 0.9-1.8, 2026-12-04, over the
# fused matrices the model runs: the swapped form was faster at 2 tokens (2.72-2.77x) and 4 (1.38-1.44x) in every
# run that measured them (2, 6 and 12 tokens: only the two runs that had them), tied at 1, 6 and 8 (0.93-1.03x),
# and slower from 12 tokens on (0.60x at 12, 0.87-0.95x at 16-64). The largest count where it won in every run that
# measured it is 4. (The limit was 64 before,
# set on unfused matrices, which the runs above do not support.) `bench linear` on the CPU at hand says where its
# crossover is.
SWAP_AB_MAX_TOKENS = 4


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
    matrices. On a 2-core VM of the course the swapped call was faster at 2 and 4 tokens in every run, tied
    at 1, 6 and 8, and slower from 12 tokens on (SWAP_AB_MAX_TOKENS above says which runs). GPU GEMM kernels play
    the same trick on decode-sized batches under the same name (vLLM's CUTLASS FP8 GEMMs have swap-AB
    configurations for small batches), so that the tiny
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
