"""Chapter 07 — the attention backend switch: which code runs the AttentionFn of a step.

    "torch"   chapter 05's PagedAttention: gather the blocks (index_select), then torch's SDPA
    "triton"  this chapter's kernels: store K/V through slot_mapping, one paged kernel reads the pool in place

Default: "triton" on a CUDA device, "torch" on the CPU. On the CPU, Triton runs only in its
interpreter (numpy, one program after the other), and only if TRITON_INTERPRET=1 is in the
environment before triton is first imported (by anything: transformers imports it). `@triton.jit`
reads it when a function is defined, and Triton's own library functions (tl.zeros, tl.max, tl.sum) are
@triton.jit functions defined at triton's import: defined without it, the interpreter cannot call them
from a kernel. This module imports no Triton, so asking for a backend never compiles anything for a
GPU that is not there.
"""

import contextlib
import os

import torch

ATTENTION_BACKENDS = ("torch", "triton")


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_attention_backend(name: str | None, device: torch.device | str = "cpu",
                              dtype: torch.dtype | None = None) -> str:
    """The backend to run on `device` with a KV pool of `dtype` (None: not known yet): `name`, or the device's
    default for None. ValueError naming the fix for an unknown name, for Triton on a CPU without its
    interpreter, and for Triton's interpreter with a bfloat16 pool (its tl.dot gets bf16 inputs wrong).

    >>> resolve_attention_backend(None, "cpu")
    'torch'
    """
    device = torch.device(device)
    if name is None:
        return "triton" if device.type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    if name == "triton" and device.type == "cpu" and not interpreter_requested():
        raise ValueError("attention backend 'triton' on a CPU runs in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 in the environment (e.g. TRITON_INTERPRET=1 python -m nanoserve ...)")
    if name == "triton" and dtype == torch.bfloat16 and interpreter_requested():
        # triton 3.9's interpreter: a 16 x 16 bf16 tl.dot is off by ~1e10, so the tokens would be garbage
        raise ValueError("attention backend 'triton' in Triton's interpreter (TRITON_INTERPRET=1) cannot run a "
                         "bfloat16 KV pool: the interpreter's tl.dot gets bf16 inputs wrong. Give it a float32 or "
                         "float16 model (the pool follows the model's dtype), or use the torch backend")
    return name


# the fix for a Triton that was imported before TRITON_INTERPRET=1 was set (transformers imports triton)
INTERPRETER_FIX = ("set TRITON_INTERPRET=1 before triton itself is first imported by anything (transformers imports "
                   "it): at the start of the process, e.g. TRITON_INTERPRET=1 python ...")
# what the interpreter raises when a kernel calls a compiled-mode jit function: Triton's own tl.zeros, tl.max,
# tl.sum, ... when triton was imported before TRITON_INTERPRET=1 was set
LATE_INTERPRETER = "Cannot call @triton.jit'd outside of the scope of a kernel"


def check_launchable(kernel, device: torch.device) -> None:
    """Refuse to launch a compiled kernel on CPU tensors: Triton would try to build it for a GPU."""
    from triton.runtime.jit import JITFunction  # InterpretedFunction, what TRITON_INTERPRET=1 makes, is not one

    if device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel.__name__} was defined without Triton's interpreter, so it cannot run on the CPU: "
                           + INTERPRETER_FIX)


@contextlib.contextmanager
def stub_errors_unwrapped():
    """An exercise stub's NotImplementedError raised inside a kernel, as itself: Triton's interpreter wraps
    every error of a program in an InterpreterError (once per nested jit call), which would hide from the
    grader and the learner that a rung is simply not written yet. And the interpreter's "Cannot call
    @triton.jit'd outside of the scope of a kernel" (LATE_INTERPRETER), which names no fix, with the fix."""
    try:
        yield
    except Exception as error:
        cause = error
        while cause.__cause__ is not None and type(cause).__name__ == "InterpreterError":
            cause = cause.__cause__
        if isinstance(cause, NotImplementedError) and cause is not error:
            raise cause from None
        if isinstance(cause, RuntimeError) and LATE_INTERPRETER in str(cause) and interpreter_requested():
            raise RuntimeError(f"{LATE_INTERPRETER}: Triton's interpreter was switched on after triton was first "
                               "imported, so its own @triton.jit library functions (tl.zeros, tl.max, tl.sum) were "
                               "defined for a GPU and a kernel cannot call them; " + INTERPRETER_FIX) from error
        raise


def attention_class(name: str, paged_attention=None, store_kv=None):
    """The AttentionFn class of a resolved backend: cls(cache, metadata) -> attn(layer_idx, q, k, v).
    `paged_attention`, `store_kv` (triton only): the modules whose kernels to launch — the reference's, or a
    learner's (exercise 07)."""
    if name == "torch":
        from nanoserve.kv.paged_attention import PagedAttention

        return PagedAttention
    from functools import partial

    from nanoserve.kernels.triton_attention import TritonPagedAttention

    return partial(TritonPagedAttention, paged_attention=paged_attention, store_kv=store_kv)
