"""Exercises 4.2 and 4.3 — the memory formula: the KV bytes of a token and a sequence (4.2), then how many
sequences fit on a device (4.3). Each rung is graded on its own, with the reference's other rung.

Your version of the chapter 04 part of nanoserve/memory.py: same names, same signatures.
The chapter 02 helpers (parameter counts) and the activation estimate are given, imported below.
Replace each `raise NotImplementedError`, then run `make grade CH=04`.
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
    """Exercise 4.2. Bytes the KV cache holds for one token: everything the later tokens will read of it, in
    every layer, with DTYPE_BYTES[dtype] bytes per element.

    config: a Llama-shaped config (what `NaiveKVCache` would store per position); dtype: a key of DTYPE_BYTES.
    Returns bytes (a float when the dtype has half-byte elements). Invariants: it counts the K/V heads, not the
    query heads, so SmolLM2 with multi-head attention (9 K/V heads instead of 3) would need 3 times as much;
    hidden_size, intermediate_size and vocab_size do not change it; it equals the bytes `NaiveKVCache` allocates
    per position.

    Examples: SmolLM2 (30 layers, 3 kv heads, head_dim 64) in fp32: 46,080 B;
              Llama-3-8B (32 layers, 8 kv heads, head_dim 128) in bf16: 131,072 B.
    """
    raise NotImplementedError("Exercise 4.2: the KV cache's bytes for one token of this config, in dtype")


def kv_bytes_per_sequence(config: LlamaConfig, seq_len: int, dtype: str = "bf16") -> float:
    """Exercise 4.2. Bytes the KV cache of one sequence of `seq_len` tokens needs (all of it, as a cache
    reserved up front holds it). Llama-3-8B, bf16, 4096 tokens: 536,870,912 B = 512 MiB."""
    raise NotImplementedError("Exercise 4.2: the KV bytes of seq_len tokens")


def memory_plan(config: LlamaConfig, device_bytes: float, seq_len: int, dtype: str = "bf16",
                reserve_fraction: float = RESERVE_FRACTION) -> MemoryPlan:
    """Exercise 4.3. How many concurrent sequences of `seq_len` tokens fit on a device of `device_bytes`.

    config: the model; device_bytes: the device's memory; seq_len: tokens per sequence (prompt + output);
    dtype: of the weights, the activations and the cache alike; reserve_fraction: in [0, 1).
    Returns a MemoryPlan (its fields in nanoserve/memory.py), all in bytes except num_sequences:
      reserve        the share of the device kept free for what the plan does not count
      weights        the whole model's parameters (chapter 02's count, given above) in dtype
      activations    the temporaries of one full-length prefill (the estimate given above)
      kv_budget      what the device has left for the KV cache once those three are taken (negative when they
                     do not fit)
      kv_per_token, kv_per_sequence   4.2's answers for this config, length and dtype
      num_sequences  how many sequences of seq_len tokens the budget holds whole; a device that holds none
                     says 0
    A seq_len past the model's context (config.max_position_embeddings) raises ValueError naming both numbers.

    Example, Llama-3-8B in bf16 on an 80 GiB device, 4096 tokens: reserve 8 GiB, weights 16,060,522,496 B,
    activations 480 MiB, kv_budget 60,745,572,352 B, kv_per_sequence 512 MiB, num_sequences 113.
    Llama-3-70B the same way: its 131 GiB of weights leave a negative budget, and num_sequences is 0.
    """
    raise NotImplementedError("Exercise 4.3: a MemoryPlan of this device: where its bytes go, and how many "
                              "sequences fit")
