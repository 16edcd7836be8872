"""Chapter 18 — a quantized KV cache: each K or V row stored in 8 bits, with a scale per token and kv head.

A row is one token's key (or value) in one kv head: D = head_dim numbers. It is stored as D 8-bit codes and
one bf16 scale, x ≈ code · scale, with the scale chosen so the row's largest |x| maps to the code's largest:

    int8:  scale = max|x| / 127,  code = round(x / scale)  in [-127, 127]   (even steps: error ≤ scale / 2)
    fp8:   scale = max|x| / 448,  code = float8_e4m3fn(x / scale)         (448: e4m3's largest; relative steps)

Worked example, one row of D = 4, int8:
    x = [0.50, -1.27, 0.01, 1.00]        max|x| = 1.27, scale = 1.27 / 127 = 0.01, stored in bf16 as 0.0100098
    code = [50, -127, 1, 100]            dequantized: code · 0.0100098 = [0.5005, -1.2712, 0.0100, 1.0010]

Why per token and kv head: K rows differ in size from token to token and head to head (the RoPE'd keys of a
few heads are much larger), and a token's row is written once, when the token is computed — a scale per
block would change as the block fills and force its earlier rows to be requantized.

Bytes per token and layer (SmolLM2: 3 kv heads, D 64), K and V:  fp32 2·3·64·4 = 1536,  bf16 768,
int8 / fp8  2·3·(64 + 2) = 396: the bf16 scale costs 2 bytes per 64 codes, so 1.94× the tokens of bf16.
"""

import torch

SCALE_DTYPE = torch.bfloat16
# the largest code of each storage dtype: where a row's largest |x| lands
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (codes (..., D) of `dtype`, scales (...) bf16), one scale per row of D.

    An all-zero row gets a tiny positive scale (never 0: the division stays finite) and zero codes.
    """
    qmax = QMAX[dtype]
    amax = x.abs().amax(-1).float()  # (...,)
    # rounded to bf16 before the codes are computed, so codes · stored scale is what dequantizes
    scale = (amax / qmax).clamp(min=1e-30).to(SCALE_DTYPE)
    y = x.float() / scale.float()[..., None]
    if dtype == torch.int8:
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)  # the bf16 rounding of the scale may push |y| past 127
    else:
        codes = y.clamp(-qmax, qmax).to(dtype)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., D), scales (...) -> x (..., D) in `dtype`: codes · scale."""
    return (codes.float() * scale.float()[..., None]).to(dtype)
