"""Chapter 07 — kernels: the online softmax (plain torch), and Triton's paged attention and store-KV kernels.

Import `nanoserve.kernels.backend` freely: it imports no Triton. The `triton_*` modules define
Triton kernels, so on a CPU TRITON_INTERPRET=1 must be set before they are imported — and before triton
itself is first imported by anything (transformers does), or a kernel cannot call Triton's own @triton.jit
library functions (tl.zeros, tl.max, tl.sum), which triton defines when it is imported.
"""
