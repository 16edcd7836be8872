"""Chapter 10 — weight-only quantization: Linear layers whose weights stay small in memory.

Batch-1 decode reads every weight once per token, so its speed is at most memory bandwidth over
bytes per token. SmolLM2 in float32 is 538 MB per token; int8, 135 MB; q4 (with an int8 LM head), 95 MB.
Only the *weights* shrink here; activations, the KV cache and the residual stream stay float32.

Two formats, each a Linear that keeps its weight quantized and dequantizes inside the product:

  int8   symmetric, one scale per output row, quantized at load time from the float32 weights:
             s = max|w_row| / 127,   q = round(w / s) in -127..127,   w ≈ q · s
         torch's kernel: torch.ops.aten._weight_int8pack_mm(x, q, s)
  q4     the GGUF's own Q4_1 blocks, taken as they are: per group of 32 weights in a row,
             w = d · q + m,   q in 0..15,   d and m float16
         torch's kernel computes w = (q − 8) · scale + zero per group, so scale = d, zero = m + 8·d:
             _convert_weight_to_int4pack_for_cpu(q) once, _weight_int4pack_mm_for_cpu(x, packed, 32, sz)

Both kernels are fast only with **bfloat16 activations** (with float32 ones they are slower
than float32 MKL: `python -m nanoserve bench weights`), and they take their scales in the activation's
dtype. So a quantized layer computes, with torch's kernels (the large-step path rounds dequantize(W) to bf16
too, below; a CPU without native bf16 differs, see the end):

    bf16(x) · dequantize(W)ᵀ, accumulated in float32, rounded to bf16, returned as float32

with `dequantize` using the bf16 scales. For small products (up to `max_kernel_tokens` tokens) that is the
kernel; for larger ones the kernels are slower than a GEMM, so the layer multiplies a bf16 copy of its
weight with F.linear in bf16 (oneDNN's bf16 GEMM, on AMX tiles or AVX-512 BF16: faster than float32 MKL, and it
too accumulates in float32). Where that bf16 weight comes from is set_kernel_crossover's choice: a copy made
once (LLM's default: 2 bytes per weight more, crossover KERNEL_CROSSOVER_TOKENS = 16) or dequantized for
each large step (a bare quantized model: no memory added, one pass over the weights per step, crossover
QUANT_MAX_TOKENS = 64). Either way `dequantize()` makes it, with the dequantize function the layer was
built with. The two paths see the same inputs; the large-step path's weights carry one more rounding (to
bf16: at most 2^-8 relative, half a unit in the last of its 8 significant bits), and the order of the
float32 additions differs.

All of that holds on a CPU that multiplies bf16 natively (AMX, or AVX-512 BF16). On one that does not (no
amx_bf16 or avx512_bf16 flag: AMD's Zen 3, Intel's client CPUs and its servers before Sapphire Rapids, Cooper
Lake aside) oneDNN emulates the bf16 GEMM, and it runs several times slower
than float32's (`python -m nanoserve bench linear --bf16` on the machine at hand): there the large step's
weight is float32 instead (LARGE_STEP_DTYPE: a float32 copy, 4 bytes per weight, or dequantized per call) and
the large step multiplies float32 activations, as the oracle does. And there the small steps leave torch's
kernels for kernels/cpu_dot.c (default_integer_dot): llama.cpp's integer dot products, the activations rounded
to int8 in blocks of 32 instead of to bf16 (chapter 10, "Integers all the way").

The embedding and LM head are Q8_0 in the GGUF (int8 in groups of 32). torch's int8 kernel has one scale
per row only, so they are re-quantized per row (int8, one matrix shared by the lookup and the LM head):
kept float32, that one matrix (113 MB) would be read per token more bytes than all 30 q4 layers together.
"""

import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from nanoserve.kernels import cpu_dot

WEIGHT_FORMATS = ("fp32", "int8", "q4", "bf16")


def bf16_instructions(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """This CPU's bf16 dot-product instructions, read from the kernel's flags: "amx_bf16" (AMX's tiles; such a
    CPU has AVX-512 BF16 too), "avx512_bf16", or None (neither, or no /proc/cpuinfo to read). What tells the
    machines apart: torch.backends.cpu.get_cpu_capability() prints AVX512 on the first two alike."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if re.search(rf"\b{f}\b", flags)), None)


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 dot-product instructions, AMX's or AVX-512's (False where there is no
    /proc/cpuinfo: the float32 GEMM is the safe choice everywhere)."""
    return bf16_instructions(cpuinfo) is not None


# The dtype of a quantized layer's large-step GEMM (module docstring): bf16 where the CPU multiplies it natively
LARGE_STEP_DTYPE = torch.bfloat16 if native_bf16() else torch.float32

Q4_GROUP_SIZE = 32  # weights per Q4_1 block (and per group of the int4 kernel)
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of 32 nibbles
# Up to this many tokens (<=) a product runs in the quantized kernel; beyond, a GEMM in LARGE_STEP_DTYPE (bf16 on
# AMX tiles, or float32) on a weight in that dtype. Where that weight is dequantized for each call (a bare
# quantized model), the crossover is 64 (chapter 06's swap-AB bound until that was re-derived as 4, kept here), a
# plain default not measured for this path: decode steps (≤ 64 sequences) on the kernel, prefill chunks on the GEMM
# (bench weights' dequant columns put the CPU's own crossover above 64 for q4 and below it for int8, chapter 10).
# Where a copy is kept
# (LLM's default, set_kernel_crossover), the GEMM costs only itself: the int4 kernel's time grows with the rows
# (its arithmetic bounds it, unpacking every weight, even at one row), the bf16 GEMM's barely does up to ~32 rows
# on AMX, and the two cross near 16 rows, on a side of 16 that depends on the CPU (one loaded AMX run: between 8
# and 16; AVX-512 BF16 without AMX: between 16 and 32; `python -m nanoserve bench linear --formats fp32 bf16 q4`,
# chapter 10 "The crossover"). 16 is a default that keeps every batch-16 decode step on the kernel, not a measured
# optimum; a config value: LLM(kernel_crossover_tokens=...).
QUANT_MAX_TOKENS = 64
KERNEL_CROSSOVER_TOKENS = 16
# How a quantized layer gets its large-step weight (LARGE_STEP_DTYPE): "dequantize" it per call (no extra memory,
# one pass over the weight per step) or keep a "copy" beside the quantized one (2 bytes per weight more in
# bf16, 4 in float32).
LARGE_STEP_WEIGHTS = ("dequantize", "copy")
INT4_INNER_K_TILES = 2  # a layout parameter of the packing; the CPU kernel accepts 1, 2, 4, 8


def check_weight_format(weights: str) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights {weights!r}; known: {', '.join(WEIGHT_FORMATS)}")
    return weights


# ---- int8, symmetric, per output channel -------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> q (out, in) int8 in -127..127 and scale (out,) bfloat16, w ≈ q · scale.

    The scale is rounded to bf16 *before* q is computed, so q is the best int8 for the scale the kernel
    will actually multiply by. Example, one row [0.5, -1.27, 0.01]: s = 1.27 / 127 = 0.01 (bf16: 0.010009...),
    q = [50, -127, 1], error ≤ s / 2 per weight.
    """
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-30).to(torch.bfloat16)  # (out,); an all-zero row gets q = 0
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]  # (out, in)


# ---- Q4_1 blocks, as the GGUF stores them ------------------------------------------------------------

def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 bytes (rows, in/32, 20) uint8 -> q (rows, in) uint8 in 0..15, d and m (rows, in/32) float32.

    One block of 20 bytes:  d (2 bytes, float16) | m (2 bytes, float16) | qs (16 bytes)
    byte j of qs holds weight j in its low nibble and weight j + 16 in its high nibble.
    """
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != Q4_1_BLOCK_BYTES:
        raise ValueError(f"Q4_1 blocks must be a (rows, in/32, {Q4_1_BLOCK_BYTES}) uint8 tensor, "
                         f"got {tuple(blocks.shape)} {blocks.dtype}")
    rows, num_blocks, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # (rows, num_blocks)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = blocks[..., 4:]  # (rows, num_blocks, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (rows, num_blocks, 32): weights 0..15, then 16..31
    return q.reshape(rows, num_blocks * Q4_GROUP_SIZE), d, m


def int4_scale_and_zero(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1's (d, m) -> the int4 kernel's (scale, zero), (rows, in/32) float32 each, so that the kernel's
    (q − 8) · scale + zero is Q4_1's d · q + m for every q in 0..15: scale = d, zero = m + 8·d.

    Example, one block with d = 0.5, m = -3: q = 0 is -3 and q = 15 is 4.5 in both forms; the kernel's
    scale 0.5 and zero 1.0 ((0 − 8) · 0.5 + 1 = -3). The integers go into the kernel unchanged.
    """
    return d, m + 8 * d


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's rule, w = (q − 8) · scale + zero per group of 32. q (out, in), scale/zero (out, in/32)."""
    out, inp = q.shape
    groups = q.view(out, inp // Q4_GROUP_SIZE, Q4_GROUP_SIZE).to(torch.float32, copy=True)  # (out, in/32, 32)
    # in place on that one float32 copy: a bare model's weights all pass through here per large step
    return groups.sub_(8).mul_(scale.float()[..., None]).add_(zero.float()[..., None]).view(out, inp)


# ---- the layers ------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """What both formats share: bf16 into the kernel for small batches, the large-step GEMM for big ones.

    Subclasses give `kernel(x_bf16)` (BF16Linear, with no small-step kernel, none) and `dequantize()`; `name`
    (e.g. "layers.3.mlp.up_proj") is for errors.
    The quantized tensors are non-persistent buffers: they are built from the GGUF, not from a state_dict.
    """

    def __init__(self, in_features: int, out_features: int, name: str):
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.max_kernel_tokens = QUANT_MAX_TOKENS  # set_kernel_crossover changes it
        self.large_step_copy: torch.Tensor | None = None  # large_step_weights="copy" keeps one
        self.integer_dot = False  # small steps in cpu_dot.c's integer products instead of torch's kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), in x's dtype
        x2 = x.reshape(-1, self.in_features)  # (num_tokens, in)
        if x2.shape[0] <= self.max_kernel_tokens:
            y = self.kernel(x2)
        else:  # a large step: the weight in LARGE_STEP_DTYPE (kept, or dequantized for this call only), one GEMM
            w = self.large_step_weight()
            y = F.linear(x2.to(w.dtype), w)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def large_step_weight(self) -> torch.Tensor:  # (out, in) in LARGE_STEP_DTYPE
        if self.large_step_copy is not None:
            return self.large_step_copy
        return self.dequantize().to(LARGE_STEP_DTYPE)

    def extra_repr(self) -> str:
        return f"{self.name}: in={self.in_features}, out={self.out_features}"


class Int8Linear(QuantLinear):
    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, name: str = "", dequantize=dequantize_int8):
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
            raise ValueError(f"{name}: int8 weights must be (out, in) int8 with (out,) scales, "
                             f"got {tuple(qweight.shape)} {qweight.dtype} and {tuple(scale.shape)}")
        super().__init__(qweight.shape[1], qweight.shape[0], name)
        self.register_buffer("qweight", qweight, persistent=False)  # (out, in) int8
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)  # (out,)
        self.register_buffer("scale_f32", self.scale.float(), persistent=False)  # (out,) the same, for cpu_dot
        self.dequantize_int8 = dequantize  # the reference's, or exercise 10's (quantize_model's `functions`)

    @classmethod
    def from_float(cls, weight: torch.Tensor, name: str = "", quantize=quantize_int8,
                   dequantize=dequantize_int8) -> "Int8Linear":
        return cls(*quantize(weight.detach()), name, dequantize)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in) -> (num_tokens, out)
        if self.integer_dot:
            matmul = cpu_dot.int8_matmul_op if torch.compiler.is_compiling() else cpu_dot.int8_matmul
            return matmul(x, self.qweight, self.scale_f32)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_int8(self.qweight, self.scale)

    def nbytes(self) -> int:
        return self.qweight.numel() + 2 * self.scale.numel()


class Q4Linear(QuantLinear):
    """A Linear served from Q4_1 blocks: the 4-bit integers and the block's (d, m) as the GGUF stores them.

    Kept: `blocks` (out, in/32, 20), the file's bytes (`dequantize` unpacks their nibbles), `packed`
    (out, in/2), the same integers in torch's int4 kernel layout (a layout private to the kernel), and
    `scale_and_zero` (in/32, out, 2) bf16 = (d, m + 8·d), the kernel's argument. bf16 because the kernel
    takes its scales in the activations' dtype: d loses its 3 lowest bits of float16 mantissa there.
    """

    def __init__(self, blocks: torch.Tensor, name: str = "", unpack=unpack_q4_1, to_int4=int4_scale_and_zero,
                 dequantize=dequantize_q4):
        try:
            q, d, m = unpack(blocks)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        out, inp = q.shape
        if out % 16:  # _convert_weight_to_int4pack_for_cpu refuses it; say so here, with the layer's name
            raise ValueError(f"{name}: torch's int4 CPU kernel needs out_features divisible by 16, got {out}; "
                             f"serve this model with weights='int8' or 'fp32'")
        super().__init__(inp, out, name)
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), INT4_INNER_K_TILES), persistent=False)
        scale_and_zero = torch.stack(to_int4(d, m), dim=-1).transpose(0, 1)  # (in/32, out, 2)
        self.register_buffer("scale_and_zero", scale_and_zero.contiguous().to(torch.bfloat16), persistent=False)
        self.dequantize_q4 = dequantize  # the reference's, or exercise 10's (quantize_model's `functions`)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, in) -> (num_tokens, out)
        if self.integer_dot:
            matmul = cpu_dot.q4_1_matmul_op if torch.compiler.is_compiling() else cpu_dot.q4_1_matmul
            return matmul(x, self.blocks)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, Q4_GROUP_SIZE,
                                                           self.scale_and_zero)

    def unpacked(self) -> torch.Tensor:
        """The 4-bit integers (out, in) uint8 in 0..15, from the file's bytes."""
        qs = self.blocks[..., 4:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        scale, zero = self.scale_and_zero.transpose(0, 1).unbind(-1)  # (out, in/32) each
        return self.dequantize_q4(self.unpacked(), scale, zero)

    def nbytes(self) -> int:
        """Bytes a decode step reads: the packed integers and the bf16 scales and zeros."""
        return self.packed.numel() + 2 * self.scale_and_zero.numel()


class BF16Linear(QuantLinear):
    """`weights="bf16"`: the weight rounded to bfloat16 (2 bytes, 8 bits of mantissa), every product a bf16
    GEMM accumulated in float32 (oneDNN; AMX tiles where the CPU has them). No small-step kernel: every step takes the GEMM."""

    def __init__(self, weight: torch.Tensor, name: str = ""):
        super().__init__(weight.shape[1], weight.shape[0], name)
        self.register_buffer("weight", weight.detach().to(torch.bfloat16), persistent=False)  # (out, in)
        self.max_kernel_tokens = -1  # no small-step kernel: always the GEMM

    def large_step_weight(self) -> torch.Tensor:  # the format is bf16: its every product is a bf16 GEMM
        return self.weight

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def nbytes(self) -> int:
        return 2 * self.weight.numel()


class BF16Embedding(nn.Module):
    """The bf16 table, looked up and returned as float32 (the residual stream stays float32)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # (vocab, hidden) bf16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden) float32
        return self.weight[ids].float()


def check_crossover(max_kernel_tokens: int | None, large_step_weights: str) -> None:
    """ValueError for a crossover set_kernel_crossover cannot honour: an unknown large_step_weights or a token count
    that is not an int >= 0 (None: the default)."""
    if large_step_weights not in LARGE_STEP_WEIGHTS:
        raise ValueError(f"unknown large_step_weights {large_step_weights!r}; known: {', '.join(LARGE_STEP_WEIGHTS)}")
    if max_kernel_tokens is not None and (not isinstance(max_kernel_tokens, int) or max_kernel_tokens < 0):
        raise ValueError(f"kernel_crossover_tokens must be an int >= 0, got {max_kernel_tokens!r}")


def set_kernel_crossover(model, max_kernel_tokens: int | None = None, large_step_weights: str = "copy"):
    """Per step, which product a quantized layer runs: its int8/int4 kernel up to `max_kernel_tokens` tokens,
    a GEMM in LARGE_STEP_DTYPE beyond, on a weight kept as a copy or dequantized per call (`large_step_weights`,
    one of LARGE_STEP_WEIGHTS). Default tokens: KERNEL_CROSSOVER_TOKENS with a copy, QUANT_MAX_TOKENS without.
    Returns the bytes the copies add (0 for "dequantize")."""
    check_crossover(max_kernel_tokens, large_step_weights)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and not isinstance(m, BF16Linear)]
    default = KERNEL_CROSSOVER_TOKENS if large_step_weights == "copy" else QUANT_MAX_TOKENS
    owners: dict[int, QuantLinear] = {}  # a tied LM head shares the embedding's tensors: one copy for both
    for module in layers:
        module.max_kernel_tokens = default if max_kernel_tokens is None else max_kernel_tokens
        module.large_step_copy = None
        owners.setdefault(next(iter(module.buffers())).data_ptr(), module)
    if large_step_weights == "dequantize":
        model.kernel_crossover_tokens, model.large_step_weights = max_kernel_tokens, large_step_weights
        return 0
    # copy=True: a tensor of its own, not a view of dequantize()'s scratch (a view keeps its base, and the base's
    # storage, alive however the copy is released: a sleep, chapter 19, would free nothing)
    copies = {key: m.dequantize().to(LARGE_STEP_DTYPE, copy=True) for key, m in owners.items()}  # (out, in) each
    for module in layers:
        module.large_step_copy = copies[next(iter(module.buffers())).data_ptr()]
    model.kernel_crossover_tokens, model.large_step_weights = max_kernel_tokens, large_step_weights
    return sum(c.nbytes for c in copies.values())


class Int8Embedding(nn.Module):
    """An embedding table kept as int8 rows with one scale each: row i = q[i] · scale[i].

    Its tensors are shared with the LM head's Int8Linear when the model ties them (SmolLM2 does).
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight, persistent=False)  # (vocab, hidden) int8
        self.register_buffer("scale", scale, persistent=False)  # (vocab,) bf16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden) float32
        return self.qweight[ids].float() * self.scale[ids].float()[:, None]


def default_integer_dot() -> bool:
    """Whether quantized layers take cpu_dot.c's integer products for their small steps by default: where the CPU
    has no native bf16 (torch's kernels convert every weight there, `bench linear --formats int8 q4`) and the
    library builds with its AVX2 branch (its plain C loops are slower than torch's kernels). Elsewhere torch's
    kernels stay: on AMX they are what chapter 10 measured, and cpu_dot.c has not been measured there."""
    return not native_bf16() and cpu_dot.simd()


def check_integer_dot(integer_dot: bool, weights: str, tensor_parallel_size: int = 1) -> None:
    """ValueError where an explicit integer_dot cannot be honoured."""
    if weights not in ("int8", "q4"):
        raise ValueError(f"integer_dot chooses the small-step kernel of int8 / q4 weights, not of {weights!r}")
    if tensor_parallel_size > 1:
        raise ValueError("integer_dot is single-process only (tensor parallelism runs float32 weights)")
    if integer_dot and not cpu_dot.available():
        raise ValueError(f"integer_dot=True but kernels/cpu_dot.c does not build here: {cpu_dot.build_error()}")


def reference_q4_mapping(f) -> bool:
    """Whether `f`'s Q4_1 reading (unpack_q4_1, int4_scale_and_zero) is this module's: a learner's is read only by
    torch's int4 kernel (the packed integers and its scales), which cpu_dot.c bypasses for the file's bytes."""
    return f.unpack_q4_1 is unpack_q4_1 and f.int4_scale_and_zero is int4_scale_and_zero


def quantize_model(model, weights: str, q4_blocks: dict[str, torch.Tensor] | None = None, functions=None,
                   integer_dot: bool | None = None):
    """Swap a float32 Llama's Linear layers for quantized ones, in place; returns the model.

    int8: every decoder Linear from its float32 weight. q4: every decoder Linear from `q4_blocks`
    (module name -> its GGUF Q4_1 blocks (out, in/32, 20)). Both: embedding and LM head int8 per row.
    functions: a module with the five functions of exercise 10 — `quantize_int8`, `dequantize_int8`, `unpack_q4_1`,
    `int4_scale_and_zero`, `dequantize_q4` (default: this one; exercise 10's file when the learner's quantizer
    serves, see `LLM(student=True)`). The layers keep the two dequantize functions: they make the large-step weight (LARGE_STEP_DTYPE) of a
    large step (LLM's copy, once at load, or a bare quantized model's, per large step).
    integer_dot: small steps in cpu_dot.c's integer products (True) or torch's kernels (False); None:
    default_integer_dot(). A learner's unpack_q4_1 or int4_scale_and_zero is what torch's int4 kernel reads, so
    with either the q4 layers keep torch's kernel: the learner's code serves (reference_q4_mapping).
    The layers swapped are decoder_linears(model); check_swapped refuses a model with a float matrix left over.
    """
    check_weight_format(weights)
    f = functions or sys.modules[__name__]
    model.weight_format = weights
    if weights == "fp32":
        return model
    if weights == "bf16":
        return bf16_model(model)
    if integer_dot:
        check_integer_dot(integer_dot, weights)
    integer_dot = default_integer_dot() if integer_dot is None else integer_dot
    for name, module in decoder_linears(model):
        if weights == "q4":
            if name not in (q4_blocks or {}):
                raise ValueError(f"{name}: weights='q4' needs this layer's Q4_1 blocks from the GGUF, and there are none")
            new = Q4Linear(q4_blocks[name], name, f.unpack_q4_1, f.int4_scale_and_zero, f.dequantize_q4)
            new.integer_dot = integer_dot and reference_q4_mapping(f)
        else:
            new = Int8Linear.from_float(module.weight, name, f.quantize_int8, f.dequantize_int8)
            new.integer_dot = integer_dot and new.in_features % cpu_dot.QK == 0  # the C code's blocks of 32
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    tied = model.lm_head.weight is model.embed_tokens.weight
    q, scale = f.quantize_int8(model.embed_tokens.weight.detach())
    model.embed_tokens = Int8Embedding(q, scale)
    model.lm_head = (Int8Linear(q, scale, "lm_head", f.dequantize_int8) if tied
                     else Int8Linear.from_float(model.lm_head.weight, "lm_head", f.quantize_int8, f.dequantize_int8))
    model.lm_head.integer_dot = integer_dot and model.lm_head.in_features % cpu_dot.QK == 0
    return check_swapped(model, weights)


def decoder_linears(model) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every product quantize_model and bf16_model swap: each nn.Linear but the LM head.

    nn.Linear, not nanoserve/model/layers.py's Linear: under `--student 02` the layers are built from the learner's
    files, and a layers.py that mirrors the reference's whole module defines a Linear class of its own."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name != "lm_head"]


def check_swapped(model, weights: str):
    """The model, or ValueError where a matrix is left as a float parameter after the swap: a layer that is not an
    nn.Linear keeps its float32 weight, and would serve a model that is not in `weights` (with q4 from a GGUF, a
    random one: load_gguf loads no float weight into the layers that the file's blocks are for)."""
    left = {name.rpartition(".")[0]: model.get_submodule(name.rpartition(".")[0])
            for name, p in model.named_parameters() if p.dim() > 1}
    if left:
        names = ", ".join(list(left)[:2]) + (f" and {len(left) - 2} more" if len(left) > 2 else "")
        kinds = ", ".join(sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in left.values()}))
        raise ValueError(f"weights={weights!r} swaps each decoder layer that is a torch.nn.Linear; {names} "
                         f"({kinds}) is not one and would keep its float32 weight: subclass nn.Linear, as "
                         f"nanoserve/model/layers.py's Linear does, or serve weights='fp32'")
    return model


def bf16_model(model):
    """Every Linear (LM head included) a BF16Linear; the embedding bf16 too (shared with a tied head)."""
    for name, module in decoder_linears(model):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, BF16Linear(module.weight, name))
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.lm_head = BF16Linear(model.lm_head.weight, "lm_head")
    model.embed_tokens = BF16Embedding(model.lm_head.weight if tied else
                                       model.embed_tokens.weight.detach().to(torch.bfloat16))
    return check_swapped(model, "bf16")


def resident_bytes(model) -> int:
    """Bytes of every tensor the model holds (a tensor shared by two modules counted once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_bytes(model) -> int:
    """Bytes of weights one decode step reads: every product's weights once (a q4 layer's kernel copy,
    scales and zeros included) and the norms; the embedding is left out (a lookup reads one row)."""
    from nanoserve.model.layers import Linear, RMSNorm

    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes()
        elif isinstance(module, (Linear, RMSNorm)):
            total += module.weight.numel() * module.weight.element_size()
    return total
