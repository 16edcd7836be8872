"""Exercises 4.2 and 4.3 — the memory formula: the KV bytes of a token and a sequence (4.2), then how many
sequences fit on a device (4.3). Each rung is graded on its own, with the reference's other rung.

Your version of the chapter 04 part of nanoserve/memory.py: same names, same signatures.
The chapter 02 helpers (parameter counts) and the activation estimate are given, imported below.
Replace each `raise NotImplementedError`, then run `make grade CH=04`.

    KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element
"""

from nanoserve.memory import (  # noqa: F401  (given: the tests and the CLI use them through this module)
    DTYPE_BYTES,
    GiB,
    RESERVE_FRACTION,
    MemoryPlan,
    activation_bytes,
    format_bytes,
    layer_parameter_counts,
    parameter_counts,
)
from nanoserve.model.config import LlamaConfig


def kv_bytes_per_token(config: LlamaConfig, dtype: str = "bf16") -> float:
    """Exercise 4.2. Bytes the KV cache needs for one token (DTYPE_BYTES[dtype] bytes per element).

    SmolLM2 fp32: 2 · 30 · 3 · 64 · 4 = 46,080 B;  Llama-3-8B bf16: 2 · 32 · 8 · 128 · 2 = 131,072 B.
    """
    raise NotImplementedError("Exercise 4.2: 2 × layers × kv_heads × head_dim × bytes per element")


def kv_bytes_per_sequence(config: LlamaConfig, seq_len: int, dtype: str = "bf16") -> float:
    """Exercise 4.2. Bytes the KV cache of one sequence of `seq_len` tokens needs (all of it, as a cache
    reserved up front holds it). Llama-3-8B, bf16, 4096 tokens: 536,870,912 B = 512 MiB."""
    raise NotImplementedError("Exercise 4.2: the KV bytes of seq_len tokens")


def memory_plan(config: LlamaConfig, device_bytes: float, seq_len: int, dtype: str = "bf16",
                reserve_fraction: float = RESERVE_FRACTION) -> MemoryPlan:
    """Exercise 4.3. How many concurrent sequences of `seq_len` tokens fit on a device of `device_bytes`.

    Returns a MemoryPlan (see its fields in nanoserve/memory.py), all in bytes except num_sequences:
      reserve       the share `reserve_fraction` of the device kept free
      weights       every parameter (parameter_counts(config)["total"]) in `dtype`
      activations   activation_bytes(config, seq_len, dtype): one full-length prefill
      kv_budget     what the device has left after those three (negative when they do not fit)
      num_sequences whole sequences of seq_len tokens in kv_budget: an int, never below 0
    Raise ValueError naming both numbers when seq_len exceeds config.max_position_embeddings.

    Llama-3-8B, bf16, an 80 GiB device, 4096 tokens:
    (80 GiB − 8 GiB reserve − 16,060,522,496 B weights − 480 MiB activations) // 512 MiB = 113 sequences.
    """
    raise NotImplementedError("Exercise 4.3: what is left of the device for the KV cache, in whole sequences")
