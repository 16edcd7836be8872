"""Chapter 09 — a compiled step: the model's forward through torch.compile, on a fixed set of batch sizes.

Eager PyTorch runs a decode step op by op: every RMSNorm is six small kernels (cast, square, mean, rsqrt,
two multiplies), RoPE five, SiLU · up two, each one a Python call, a dispatch and a pass over memory. At
batch 1 the tensors are a few KB, so the step's time is that fixed cost, not the arithmetic
(`python -m nanoserve bench profile`: "norms/RoPE/act"). torch.compile (TorchDynamo captures the ops,
inductor writes one C++ loop per group of element-wise ops and compiles it with gcc) turns a layer's
element-wise work into a few fused loops; the products stay calls into MKL / oneDNN / torch's int4 kernel.

    ids (N,) ─ pad to the bucket B >= N ─▶ compiled forward (B,) ─▶ hidden[:N]
                                              │  per layer: [norm · qkv · RoPE]  attention  [o · add · norm · MLP · add]
                                              │              a graph            eager        a graph
                                              ▼
                     attention sees only the N real tokens; the B − N padding rows get zeros and write no K/V

Two things a compiled graph cannot do, and what is done instead:
  - The attention reads the step's metadata in Python (which sequences decode, their block tables) and
    writes the KV pool: `block.attend` is marked torch.compiler.disable, so each layer's graph stops
    before it and resumes after it.
  - A graph is specialised to its input shapes (dynamic=False), and a step's token count changes every
    step. So the flat batch is padded up to the next of a few fixed sizes, BUCKETS (vLLM's CUDA-graph
    capture sizes are the same idea); a step larger than the largest bucket (a prefill chunk) runs eagerly,
    where the products dominate and op dispatch is a small share. dynamic=True (one graph with a symbolic
    token count) is the other route; `bench peers --compile-mode buckets dynamic` measures both.

The padding rows: token id 0 at position 0. They go through the products and norms like any row (a row never
mixes with another there), and `PaddedAttention` hands the attention only the first N rows, so they are
never stored in the KV pool; their outputs are dropped. Compiled code is cached on disk (inductor's
FX-graph cache, TORCHINDUCTOR_CACHE_DIR, default ~/.cache/nanoserve/inductor): a second start reads the
compiled kernels instead of running gcc again.
"""

import functools
import os
from pathlib import Path

import torch
from torch.nn import functional as F

from nanoserve.model.block import AttentionFn, DecoderBlock

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # token counts a step is padded up to; decode steps of up to 64 sequences
COMPILE_MODES = ("eager", "buckets", "dynamic")


def inductor_cache_dir() -> Path:
    """Where inductor keeps its compiled kernels: $TORCHINDUCTOR_CACHE_DIR if set, else the user's cache."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None:
        path = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanoserve" / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by inductor when it first compiles
    return Path(path)


class PaddedAttention:
    """The step's AttentionFn seen through a padded batch: the first `num_tokens` rows are the step's,
    the rest padding. attn(layer, q (B, H, D), k, v (B, Hkv, D)) -> (B, H, D), padding rows zero."""

    def __init__(self, attn: AttentionFn, num_tokens: int):
        self.attn, self.num_tokens = attn, num_tokens

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.num_tokens
        out = self.attn(layer_idx, q[:n], k[:n], v[:n])  # (n, H, D); the padding rows reach no KV slot
        return F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - n))  # (B, H, D)


class CompiledModel:
    """A Llama whose steps run compiled: model(ids, positions, attn) and compute_logits, as the Llama's.

    mode: "buckets" (dynamic=False, the batch padded up to `buckets`) or "dynamic" (graphs whose token count
    is symbolic, no padding). The weights are the model's own: nothing is copied.
    """

    def __init__(self, model, mode: str = "buckets", buckets: tuple[int, ...] = BUCKETS):
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"unknown compile mode {mode!r}; known: {', '.join(COMPILE_MODES[1:])}")
        inductor_cache_dir()
        self.model, self.mode = model, mode
        self.buckets = tuple(sorted(buckets)) if mode == "buckets" else ()
        self.config = model.config
        self.weight_format = getattr(model, "weight_format", "fp32")
        # Two graphs per layer, compiled as functions of the block: all 30 blocks run the same code on weights
        # of the same shapes, so one compiled graph per token count serves every layer.
        compile = functools.partial(torch.compile, dynamic=(mode == "dynamic"), fullgraph=True)
        self.embed = compile(type(model).embed)
        self.attention_input = compile(DecoderBlock.attention_input)
        self.attention_output = compile(DecoderBlock.attention_output)
        self.norm = compile(type(model.norm).forward)
        # The course's one private torch setting (global, and renamed recompile_limit in newer torch, which keeps
        # this name as an alias): no public API says how many graphs a compiled function may keep, and a graph
        # per bucket can need more than the default (8) before dynamo falls back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets))

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket >= num_tokens (None: larger than all, and the step runs eagerly)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        n = input_ids.shape[0]
        if self.mode == "dynamic":
            return self.forward(input_ids, positions, attn)
        size = self.bucket(n)
        if size is None:
            return self.model(input_ids, positions, attn)
        pad = size - n  # padding rows: token 0 at position 0
        hidden = self.forward(F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)), PaddedAttention(attn, n))
        return hidden[:n]  # (n, hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Llama.forward's loop (the position check left to the caller), each block cut at its attention."""
        x, cos, sin = self.embed(self.model, input_ids, positions)
        for block in self.model.layers:
            q, k, v = self.attention_input(block, x, cos, sin)
            x = self.attention_output(block, x, attn(block.self_attn.layer_idx, q, k, v))
        return self.norm(self.model.norm, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def parameters(self):
        return self.model.parameters()
