"""Exercise 10 — weight-only quantization: int8 per output channel, and the GGUF's Q4_1 blocks.

Your version of the four functions of nanoserve/model/quant.py that make a quantized model's weights:
same names, same signatures. The layers that use them (Int8Linear, Q4Linear, the embedding) and
`quantize_model` are given, imported below. Replace each `raise NotImplementedError`, then run
`make grade CH=10`; then serve with YOUR weights: `python -m nanoserve batch --weights q4 --student ...`.

    int8:  s = max|w_row| / 127 (rounded to bf16),  q = round(w / s) in -127..127,  w ≈ q · s
    Q4_1:  a block of 20 bytes = d (float16) | m (float16) | 16 bytes of nibbles;  w = d · q + m
"""

import torch

from nanoserve.model.quant import (  # noqa: F401  (given: the engine uses them through this module)
    Q4_1_BLOCK_BYTES,
    Q4_GROUP_SIZE,
    QUANT_MAX_TOKENS,
    WEIGHT_FORMATS,
    Int8Embedding,
    Int8Linear,
    Q4Linear,
    QuantLinear,
    check_weight_format,
    decode_bytes,
    quantize_model,
    resident_bytes,
)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.1. (out, in) float -> q (out, in) int8 in -127..127 and scale (out,) bfloat16, w ≈ q · scale.

    Round the scale to bf16 *first* (the kernel multiplies by the bf16 value), then q = round(w / scale)
    with that scale, clamped to -127..127. Keep an all-zero row from dividing by zero (clamp the scale
    to a tiny positive number, e.g. 1e-30). Example: row [0.5, -1.27, 0.01] -> q [50, -127, 1].
    """
    raise NotImplementedError("Exercise 10.1: scale = max|w| / 127 per row (bf16), q = round(w / scale)")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exercise 10.1. q (out, in) int8, scale (out,) -> float32 (out, in) = q · scale, row by row."""
    raise NotImplementedError("Exercise 10.1: q times its row's scale, in float32")


def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 10.2. GGUF Q4_1 bytes (rows, in/32, 20) uint8 -> q (rows, in) uint8 in 0..15,
    d and m (rows, in/32) float32.

    Bytes 0-1 of a block are d as float16, bytes 2-3 are m as float16 (`.contiguous().view(torch.float16)`
    reinterprets two uint8 as one float16); byte 4 + j holds weight j in its low nibble (`& 0x0F`) and
    weight j + 16 in its high nibble (`>> 4`). Raise ValueError for anything but a (rows, n, 20) uint8 tensor.
    """
    raise NotImplementedError("Exercise 10.2: d, m from bytes 0-3 (float16); low nibbles then high nibbles")


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Exercise 10.2. The int4 kernel's rule, w = (q − 8) · scale + zero per group of 32 weights in a row.

    q (out, in), scale and zero (out, in/32) -> float32 (out, in). With scale = d and zero = m + 8·d
    it gives back Q4_1's w = d · q + m.
    """
    raise NotImplementedError("Exercise 10.2: view q as (out, in/32, 32) groups, (q - 8) * scale + zero")
