"""Exercise 4.2 — the memory formula: how many sequences fit on a device.

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
    """Exercise 4.2. Bytes the KV cache of one sequence of `seq_len` tokens needs."""
    raise NotImplementedError("Exercise 4.2: the KV bytes of seq_len tokens")


def memory_plan(config: LlamaConfig, device_bytes: float, seq_len: int, dtype: str = "bf16",
                reserve_fraction: float = RESERVE_FRACTION) -> MemoryPlan:
    """Exercise 4.2. How many concurrent sequences of `seq_len` tokens fit on a device of `device_bytes`.

    Fill a MemoryPlan:
      reserve     = device_bytes × reserve_fraction
      weights     = parameter_counts(config)["total"] × bytes per element
      activations = activation_bytes(config, seq_len, dtype)     (one full-length prefill)
      kv_budget   = device − reserve − weights − activations
      num_sequences = kv_budget // kv_per_sequence, as an int, and 0 (not negative) when nothing fits.
    Raise ValueError naming both numbers when seq_len exceeds config.max_position_embeddings.
    """
    raise NotImplementedError("Exercise 4.2: subtract reserve, weights and activations; divide by the KV of a sequence")
