"""Chapter 10 — llama.cpp's integer dot products on the CPU: cpu_dot.c, built with this machine's gcc.

torch's int4 / int8 kernels multiply in bf16. Where the CPU has no native bf16 (AVX2 only: AMD's Zen 3, Intel
before Cooper Lake) converting each weight costs more than reading it, and a decode step's products run at a
fraction of memory speed. cpu_dot.c keeps the arithmetic in integers as llama.cpp does: each token's activations
are rounded to int8 in blocks of 32 (one scale each), and every block of weights meets them in one integer
multiply-add. The Q4_1 weights are read straight from the GGUF's blocks (d and m float16, 16 bytes of nibbles).

What it costs: the activations lose precision too. A block's largest |x| maps to 127, so an element is off by
at most dx / 2 = max|x| / 254 (bf16's rounding, the torch kernels' path, is relative to each element, 2^-8).
tests/test_ch10_cpu_dot.py checks both functions against the same arithmetic in plain torch.

The library is compiled once per process, into a temporary folder removed right after it is loaded;
`available()` is False where there is no gcc or the build fails (`build_error()` says why, and a warning once),
and the layers keep torch's kernels; so do they where the build has no AVX2 (`simd()`). Threads: the C loops
split the output rows over torch's thread count (`torch.get_num_threads()`), in the OpenMP runtime torch itself
uses (the library links libgomp.so.1, the one torch already loaded).
"""

import ctypes
import functools
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_dot.c")
QK = 32  # weights (and activations) per block
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]  # AVX2 where the CPU has it


@functools.cache
def library() -> ctypes.CDLL | None:
    """cpu_dot.c built for this CPU and loaded, or None where it cannot be (no gcc, a failed build: the reason
    in build_error(), and one warning)."""
    lib = build(CFLAGS)
    if lib is None:
        warnings.warn(f"kernels/cpu_dot.c: {build_error()}; quantized layers keep torch's kernels", RuntimeWarning)
    return lib


_errors: dict[tuple, str] = {}  # (*gcc flags, source file) -> why that build failed


def build(cflags: list[str], source: Path = SOURCE) -> ctypes.CDLL | None:
    """cpu_dot.c (or a source that includes it: cpu_decode.c) compiled with these gcc flags and loaded (without
    -march=native: the plain C branch)."""
    gcc = shutil.which("gcc")
    key = (*cflags, source.name)
    if gcc is None:
        _errors[key] = "no gcc on PATH"
        return None
    with tempfile.TemporaryDirectory(prefix=f"nanoserve_{source.stem}_") as tmp:
        path = Path(tmp) / f"{source.stem}.so"
        done = subprocess.run([gcc, *cflags, "-o", str(path), str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            _errors[key] = f"gcc failed: {last}"
            return None
        lib = ctypes.CDLL(str(path))  # mapped now: the file can go with the folder
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_q4_1.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.gemv_i8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    for f in (lib.gemv_q4_1, lib.gemv_i8, lib.cpu_dot_simd):
        f.restype = ctypes.c_int
    return lib


def build_error(cflags: list[str] = CFLAGS, source: Path = SOURCE) -> str:
    """Why the build with these flags (default: this CPU's) failed ('' if it did not, or was not tried)."""
    return _errors.get((*cflags, source.name), "")


def available() -> bool:
    return library() is not None


def simd() -> bool:
    """Whether this CPU's build took the AVX2 branch."""
    return available() and bool(library().cpu_dot_simd())


def _args(x: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the C code reads it (contiguous float32) and the output. A decode step's product is tens of
    microseconds, so the common case (x already so) costs no op at all."""
    if x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"cpu_dot multiplies (tokens, in) CPU tensors, got {tuple(x.shape)} on {x.device}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.contiguous().float()
    if x.shape[1] % QK:
        raise ValueError(f"cpu_dot needs in_features divisible by {QK}, got {x.shape[1]}")
    return x, torch.empty(x.shape[0], out_features)


def _done(status: int) -> None:
    if status != 0:  # the C code's malloc of the activations' int8 blocks failed
        raise MemoryError("cpu_dot: no memory for the activations' int8 blocks")


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The C code reads raw memory: refuse a tensor that is not exactly what it will read."""
    if t.device.type != "cpu" or t.dtype != dtype or t.shape != shape:
        raise ValueError(f"cpu_dot: {name} must be {dtype} {shape} on the CPU, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t if t.is_contiguous() else t.contiguous()


def q4_1_matmul(x: torch.Tensor, blocks: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(tokens, in) float, Q4_1 blocks (out, in/32, 20) uint8 -> (tokens, out) float32: x · Wᵀ, x in Q8_1.
    lib: a build() of the library (default: this CPU's)."""
    out = blocks.shape[0]
    x, y = _args(x, out)
    blocks = _check("blocks", blocks, torch.uint8, (out, x.shape[1] // QK, 20))
    _done((lib or library()).gemv_q4_1(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], out,
                                       torch.get_num_threads()))
    return y


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(tokens, in) float, int8 (out, in) with float32 scales (out,) -> (tokens, out) float32, x in Q8_1."""
    out = qweight.shape[0]
    x, y = _args(x, out)
    qweight = _check("qweight", qweight, torch.int8, (out, x.shape[1]))
    scale = _check("scale", scale, torch.float32, (out,))
    _done((lib or library()).gemv_i8(qweight.data_ptr(), scale.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0],
                                     x.shape[1], out, torch.get_num_threads()))
    return y


# Inside torch.compile (chapter 09's compiled step) the two products are custom ops: opaque calls in the graph
# with the output's shape declared. Outside it they are called directly: a custom op's dispatch costs tens of µs
# per call, as much as a small layer's product.
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
