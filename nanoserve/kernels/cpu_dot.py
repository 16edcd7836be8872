"""Chapter 10 — llama.cpp's integer dot products on the CPU: cpu_dot.c, built with this machine's gcc.

torch's int4 / int8 kernels multiply in bf16. Where the CPU has no native bf16 (AVX2 only: AMD's Zen 3, Intel
before Cooper Lake) converting each weight costs more than reading it, and a decode step's products run at a
fraction of memory speed. cpu_dot.c keeps the arithmetic in integers as llama.cpp does: each token's activations
are rounded to int8 in blocks of 32 (one scale each), and every block of weights meets them in one integer
multiply-add. The Q4_1 weights are read straight from the GGUF's blocks (d and m float16, 16 bytes of nibbles).

What it costs: the activations lose precision too. A block's largest |x| maps to 127, so an element is off by
at most dx / 2 = max|x| / 254 (bf16's rounding, the torch kernels' path, is relative to each element, 2^-9).
tests/test_ch10_cpu_dot.py checks both functions against the same arithmetic in plain torch.

The library is compiled once per process, into a temporary folder removed right after it is loaded (a few
hundred ms); `available()` is False where there is no gcc or the build fails, and the layers keep torch's
kernels. Threads: the C loops split the output rows over torch's thread count (`torch.get_num_threads()`), in
the OpenMP runtime torch itself uses (the library links libgomp.so.1, the one torch already loaded).
"""

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_dot.c")
QK = 32  # weights (and activations) per block
Q8_1_BLOCK_BYTES = 40  # float dx, float sx, 32 int8: one block of quantized activations (scratch)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]  # AVX2 where the CPU has it


@functools.cache
def library() -> ctypes.CDLL | None:
    """cpu_dot.c built for this CPU and loaded, or None where it cannot be (no gcc, a failed build)."""
    return build(CFLAGS)


def build(cflags: list[str]) -> ctypes.CDLL | None:
    """cpu_dot.c compiled with these gcc flags and loaded (without -march=native: the plain C branch)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="nanoserve_cpu_dot_") as tmp:
        path = Path(tmp) / "cpu_dot.so"
        done = subprocess.run([gcc, *cflags, "-o", str(path), str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        lib = ctypes.CDLL(str(path))  # mapped now: the file can go with the folder
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_q4_1.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.gemv_i8.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    for f in (lib.gemv_q4_1, lib.gemv_i8):
        f.restype = None
    return lib


def available() -> bool:
    return library() is not None


def _args(x: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as the C code reads it (contiguous float32), the output and the activations' scratch."""
    x = x.contiguous().float()
    tokens, inp = x.shape
    if inp % QK:
        raise ValueError(f"cpu_dot needs in_features divisible by {QK}, got {inp}")
    y = torch.empty(tokens, out_features)
    scratch = torch.empty(tokens * (inp // QK) * Q8_1_BLOCK_BYTES, dtype=torch.uint8)
    return x, y, scratch


def q4_1_matmul(x: torch.Tensor, blocks: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(tokens, in) float, Q4_1 blocks (out, in/32, 20) uint8 -> (tokens, out) float32: x · Wᵀ, x in Q8_1.
    lib: a build() of the library (default: this CPU's)."""
    out = blocks.shape[0]
    x, y, scratch = _args(x, out)
    blocks = blocks.contiguous()
    (lib or library()).gemv_q4_1(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), scratch.data_ptr(),
                        x.shape[0], x.shape[1], out, torch.get_num_threads())
    return y


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(tokens, in) float, int8 (out, in) with float32 scales (out,) -> (tokens, out) float32, x in Q8_1."""
    out = qweight.shape[0]
    x, y, scratch = _args(x, out)
    qweight, scale = qweight.contiguous(), scale.contiguous().float()
    (lib or library()).gemv_i8(qweight.data_ptr(), scale.data_ptr(), x.data_ptr(), y.data_ptr(), scratch.data_ptr(),
                      x.shape[0], x.shape[1], out, torch.get_num_threads())
    return y


# Inside torch.compile (chapter 09's compiled step) the two products are custom ops: opaque calls in the graph
# with the output's shape declared. Outside it they are called directly: the op's dispatch would add ~40 µs per
# call, more than a small layer's product.
@torch.library.custom_op("nanoserve::q4_1_matmul", mutates_args=())
def q4_1_matmul_op(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return q4_1_matmul(x, blocks)


@q4_1_matmul_op.register_fake
def _(x, blocks):
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


@torch.library.custom_op("nanoserve::int8_matmul", mutates_args=())
def int8_matmul_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return int8_matmul(x, qweight, scale)


@int8_matmul_op.register_fake
def _(x, qweight, scale):
    return x.new_empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
