"""Chapter 07 — kernels: the online softmax (plain torch), and Triton's paged attention and store-KV kernels.

Import `nanoserve.kernels.backend` freely: it imports no Triton. The `triton_*` modules define
Triton kernels, so on a CPU they must be imported after TRITON_INTERPRET=1 is set.
"""
