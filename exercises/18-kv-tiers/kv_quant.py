"""Exercise 18.3 — quantize a KV row to 8 bits and back (mirrors nanoserve/kv/kv_quant.py).

A row is one token's key (or value) in one kv head: head_dim numbers, stored as head_dim 8-bit codes and one
bf16 scale, x ≈ code · scale. The pool (nanoserve/kv/quantized_pool.py) calls quantize_kv when it stores a
step's K/V and dequantize_kv when a step gathers its blocks.
"""

import torch

SCALE_DTYPE = torch.bfloat16
# the largest code of each storage dtype: where a row's largest |x| lands
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 18.3. x (..., D) float -> (codes (..., D) of `dtype`, scales (...) in SCALE_DTYPE).

    One scale per row of D: scale = max|x| over the row / QMAX[dtype], rounded to bf16 *before* the codes are
    computed (so codes · the stored scale is what comes back), never below 1e-30 (an all-zero row stays
    finite). Codes: x / scale, then for int8 rounded to the nearest integer and clamped to [-127, 127]; for
    torch.float8_e4m3fn clamped to [-448, 448] and cast (the cast rounds).

    >>> codes, scale = quantize_kv(torch.tensor([[0.5, -1.27, 0.01, 1.0]]))
    >>> codes.tolist(), scale.dtype
    ([[50, -127, 1, 100]], torch.bfloat16)
    """
    raise NotImplementedError("Exercise 18.3: quantize_kv")


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exercise 18.3. codes (..., D), scales (...) -> x (..., D) in `dtype`: each code times its row's scale,
    computed in float32. int8: |x − dequantize_kv(*quantize_kv(x))| ≤ scale / 2 everywhere."""
    raise NotImplementedError("Exercise 18.3: dequantize_kv")
