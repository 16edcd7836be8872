"""Exercise 10 — weight-only quantization: int8 per output channel, and the GGUF's Q4_1 blocks.

Your version of the five functions of nanoserve/model/quant.py that make a quantized model's weights:
same names, same signatures. The layers that use them (Int8Linear, Q4Linear, the embedding) and
`quantize_model` are given, imported below. A ladder of three rungs, each graded alone
(`make grade CH=10 EX=10.2`): the reference stands in for the rungs you have not done. Then serve with
YOUR weights:
`.venv/bin/python -m nanoserve batch --input requests.jsonl --output results.jsonl --weights q4 --student 10`.

    10.1  int8, symmetric, one scale per output row      quantize_int8, dequantize_int8
    10.2  the GGUF's Q4_1 blocks, byte by byte             unpack_q4_1
    10.3  Q4_1 onto torch's int4 kernel                    int4_scale_and_zero, dequantize_q4
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

    Symmetric, one scale per output row, the largest |w| of the row landing on ±127. The kernel multiplies
    by the bf16 scale, so q must be the best integer for *that* scale: every dequantized weight within half a
    step (scale / 2) of w. An all-zero row gives q = 0 (no NaN). Example: row [0.5, -1.27, 0.01] ->
    q [50, -127, 1].
    """
    raise NotImplementedError("Exercise 10.1: int8 per output row, one bf16 scale each")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exercise 10.1. q (out, in) int8, scale (out,) -> (out, in) float32, w ≈ q · scale row by row
    (an int8 layer's weight for a large step is made with it). Example: q [50, -127, 1] with scale
    0.010009765625 (0.01 in bf16) -> [0.5005, -1.2712, 0.0100] (to 4 decimals)."""
    raise NotImplementedError("Exercise 10.1: back to float32")


def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 10.2. GGUF Q4_1 bytes (rows, in/32, 20) uint8 -> q (rows, in) uint8 in 0..15,
    d and m (rows, in/32) float32, so that weight i of a row is d[i // 32] · q[i] + m[i // 32].

    One block of 20 bytes:  d (2 bytes, float16) | m (2 bytes, float16) | qs (16 bytes)
    byte j of qs holds weight j in its low nibble and weight j + 16 in its high nibble.
    ValueError (naming the expected 20) for anything but a 3-d uint8 tensor of 20-byte blocks.
    """
    raise NotImplementedError("Exercise 10.2: a Q4_1 block's d, m and 32 integers")


def int4_scale_and_zero(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.3. Q4_1's (d, m) -> the int4 kernel's (scale, zero), (rows, in/32) float32 each.

    torch's kernel (`_weight_int4pack_mm_for_cpu`) computes each weight as (q − 8) · scale + zero with the
    very integers q of the file; Q4_1 means d · q + m. Return the scale and zero that make the two agree for
    every q in 0..15. Example, a block with d = 0.5, m = -3: q = 0 is -3.0 and q = 15 is 4.5 either way.
    """
    raise NotImplementedError("Exercise 10.3: the kernel's scale and zero from Q4_1's d and m")


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Exercise 10.3. The int4 kernel's rule, w = (q − 8) · scale + zero per group of 32 weights in a row
    (a q4 layer's weight for a large step is made with it). q (out, in) in 0..15, scale and zero (out, in/32) -> (out, in)
    float32. Example: q [0, 15, ...] in a group with scale 0.5, zero 1.0 -> [-3.0, 4.5, ...].
    """
    raise NotImplementedError("Exercise 10.3: the kernel's (q - 8) · scale + zero, group by group")
