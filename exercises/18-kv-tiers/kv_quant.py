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

    Contract (what the tests check):
      - one scale per row: the bf16 value of (the row's max|x|) / QMAX[dtype]; the row's largest |x| lands on
        ±QMAX (int8: a code of ±127), every code within [-QMAX, QMAX];
      - int8 codes are the nearest integers to x / (the *stored* bf16 scale), so dequantize_kv(codes, scale)
        is within scale / 2 of x everywhere;
      - float8_e4m3fn codes are x / the stored scale, as e4m3 represents it;
      - an all-zero row gives zero codes and a finite, positive scale (no 0 / 0).

    >>> codes, scale = quantize_kv(torch.tensor([[0.5, -1.27, 0.01, 1.0]]))
    >>> codes.tolist(), scale.dtype
    ([[50, -127, 1, 100]], torch.bfloat16)
    """
    raise NotImplementedError("Exercise 18.3: quantize_kv")


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exercise 18.3. codes (..., D), scales (...) -> x (..., D) in `dtype`, each number code · its row's scale
    (to float32 accuracy). int8: |x − dequantize_kv(*quantize_kv(x))| ≤ scale / 2 everywhere.

    >>> dequantize_kv(*quantize_kv(torch.tensor([[0.5, -1.27, 0.01, 1.0]]))).tolist()  # bf16 scale 0.0100098
    [[0.50048828125, -1.271240234375, 0.010009765625, 1.0009765625]]
    """
    raise NotImplementedError("Exercise 18.3: dequantize_kv")
