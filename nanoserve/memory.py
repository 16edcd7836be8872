"""Memory math: what a model's weights (chapter 02) and its KV cache (chapter 04) cost in bytes.

Every number here is computed from a config, so it holds for any Llama-shaped model.
For SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, head_dim 64, vocab 49152, tied):

    one layer = attention (576·576 + 2·576·192 + 576·576) + MLP 3·576·1536 + 2 norms·576
              = 884,736 + 2,654,208 + 1,152 = 3,540,096
    total     = 30 · 3,540,096 + embedding 49152·576 + final norm 576 = 134,515,008
"""

from dataclasses import dataclass

from nanoserve.model.config import LlamaConfig

# Bytes per weight. "int4" ignores the per-block scales a real 4-bit format stores
# (Q4_1 spends 2 × fp16 per 32 weights: 5 bits per weight, not 4).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}


def layer_parameter_counts(config: LlamaConfig) -> dict[str, int]:
    """Parameters of one decoder block, by sub-layer."""
    h, d = config.hidden_size, config.head_dim
    q_and_o = 2 * h * config.num_attention_heads * d
    k_and_v = 2 * h * config.num_key_value_heads * d  # GQA makes these 3× smaller here
    return {
        "attention": q_and_o + k_and_v,
        "mlp": 3 * h * config.intermediate_size,  # gate, up, down
        "norms": 2 * h,
    }


def parameter_counts(config: LlamaConfig) -> dict[str, int]:
    """Parameters of the whole model, by part; a tied LM head costs nothing extra."""
    per_layer = sum(layer_parameter_counts(config).values())
    counts = {
        "embedding": config.vocab_size * config.hidden_size,
        "per_layer": per_layer,
        "all_layers": per_layer * config.num_hidden_layers,
        "final_norm": config.hidden_size,
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size,
    }
    counts["total"] = counts["embedding"] + counts["all_layers"] + counts["final_norm"] + counts["lm_head"]
    return counts


def weight_bytes(config: LlamaConfig, weights: str = "fp32") -> float:
    """Chapter 10: bytes of the weights in one of nanoserve's formats, scales and zeros included — what the
    model holds, every matrix once (a tied embedding and LM head once). For a tied model that is what a decode
    step reads; an untied one's embedding table is held too, though a step reads only a row of it per token.

      fp32  4 B per weight
      int8  decoder Linears 1 B per weight + a bf16 scale per output row; embedding / LM head the same
      q4    decoder Linears 0.5 B per weight + a bf16 scale and zero per 32 (= 0.625 B per weight);
            embedding / LM head int8 as above (nanoserve/model/quant.py says why)
      bf16  every matrix 2 B per weight (embedding and LM head too)
    Norms stay float32 in every format. SmolLM2: 538.1 MB, 135.0 MB, 94.9 MB; bf16 269.1 MB.
    """
    from nanoserve.model.quant import check_weight_format

    check_weight_format(weights)
    counts = parameter_counts(config)
    if weights == "fp32":
        return counts["total"] * 4
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    if weights == "bf16":  # every matrix 2 B per weight, the norms float32
        return (counts["total"] - norms) * 2 + norms * 4
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    rows = config.num_attention_heads * d + 2 * config.num_key_value_heads * d + h + 2 * inter + h  # q k v o gate up down
    linear = counts["all_layers"] - 2 * h * config.num_hidden_layers  # the decoder's Linear weights
    if weights == "int8":
        layers = linear * 1 + 2 * rows * config.num_hidden_layers
    else:
        layers = linear * (0.5 + 4 / 32)
    heads = 2 if counts["lm_head"] else 1
    vocab_matrices = heads * (config.vocab_size * h + 2 * config.vocab_size)
    norms = (2 * config.num_hidden_layers + 1) * h * 4
    return layers + vocab_matrices + norms


def format_bytes(n: float) -> str:
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# ---- Chapter 04: the KV cache -------------------------------------------------------------------

GiB = 2**30
# Like vLLM's gpu_memory_utilization=0.9: a tenth of the device stays free for what the plan does
# not count (the CUDA context, the allocator's fragmentation, sampling's logits, other processes).
RESERVE_FRACTION = 0.1


def kv_bytes_per_token(config: LlamaConfig, dtype: str = "bf16") -> float:
    """Bytes the KV cache needs for one token: 2 (K and V) × layers × kv_heads × head_dim × bytes.

    SmolLM2 fp32: 2 · 30 · 3 · 64 · 4 = 46,080 B;  Llama-3-8B bf16: 2 · 32 · 8 · 128 · 2 = 131,072 B.
    """
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * DTYPE_BYTES[dtype]


def kv_bytes_per_sequence(config: LlamaConfig, seq_len: int, dtype: str = "bf16") -> float:
    """Bytes the KV cache of one sequence of `seq_len` tokens needs (all of it, if reserved up front)."""
    return seq_len * kv_bytes_per_token(config, dtype)


def activation_bytes(config: LlamaConfig, num_tokens: int, dtype: str = "bf16") -> float:
    """An estimate of the temporaries of one forward pass over `num_tokens` tokens.

    Assumptions: layers run one after another, so only one layer's temporaries are alive at a time;
    per token that layer holds the residual and its normed copy (2 · hidden), q, k, v
    ((H + 2 · Hkv) · D), the attention output (H · D) and the MLP's gate, up and their product
    (3 · intermediate). Attention is fused (FlashAttention, chapter 07): the T × S score matrix is
    never stored. The logits of one token per sequence are left to the reserve.
    """
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token = 2 * config.hidden_size + (H + 2 * Hkv) * D + H * D + 3 * config.intermediate_size
    return num_tokens * per_token * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class MemoryPlan:
    """Where a device's bytes go, and how many sequences of `seq_len` tokens fit in what is left."""

    device: float
    reserve: float
    weights: float
    activations: float
    kv_budget: float  # device − reserve − weights − activations
    kv_per_token: float
    kv_per_sequence: float
    num_sequences: int  # kv_budget // kv_per_sequence


def memory_plan(config: LlamaConfig, device_bytes: float, seq_len: int, dtype: str = "bf16",
                reserve_fraction: float = RESERVE_FRACTION) -> MemoryPlan:
    """How many concurrent sequences of `seq_len` tokens fit on a device of `device_bytes`.

    One full-length prefill (seq_len tokens) sizes the activations. Llama-3-8B, bf16, 80 GiB, 4096 tokens:
    (80 GiB − 8 GiB reserve − 16.06 GB weights − 480 MiB activations) // 512 MiB = 113 sequences.
    """
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context of {config.max_position_embeddings} tokens")
    reserve = device_bytes * reserve_fraction
    weights = parameter_counts(config)["total"] * DTYPE_BYTES[dtype]
    activations = activation_bytes(config, seq_len, dtype)
    kv_budget = device_bytes - reserve - weights - activations
    per_sequence = kv_bytes_per_sequence(config, seq_len, dtype)
    return MemoryPlan(device=device_bytes, reserve=reserve, weights=weights, activations=activations,
                      kv_budget=kv_budget, kv_per_token=kv_bytes_per_token(config, dtype),
                      kv_per_sequence=per_sequence, num_sequences=max(0, int(kv_budget // per_sequence)))


# ---- Chapter 09: the plan in blocks ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedMemoryPlan:
    """The KV budget of a MemoryPlan cut into blocks of `block_size` tokens (chapter 05's pool)."""

    block_size: int
    block_bytes: float  # block_size × kv_per_token
    num_blocks: int  # kv_budget // block_bytes
    blocks_per_sequence: int  # ceil(seq_len / block_size): a partly filled last block still costs a whole block
    num_sequences: int  # num_blocks // blocks_per_sequence
    wasted_slots_per_sequence: int  # blocks_per_sequence × block_size − seq_len


def paged_memory_plan(config: LlamaConfig, device_bytes: float, seq_len: int, block_size: int = 16,
                      dtype: str = "bf16", reserve_fraction: float = RESERVE_FRACTION) -> PagedMemoryPlan:
    """How many sequences of `seq_len` tokens a paged pool on this device holds at once, in whole blocks.

    SmolLM2 fp32 on a 2 GiB device, 1000-token sequences, blocks of 16: the KV budget is 2 GiB − 10 % − 538 MB
    weights − 29 MB activations = 1,365,491,251 B; a block is 16 · 46,080 = 737,280 B, so 1852 blocks. A sequence
    needs ceil(1000 / 16) = 63 blocks (8 slots wasted): 1852 // 63 = 29 sequences.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    plan = memory_plan(config, device_bytes, seq_len, dtype, reserve_fraction)
    block_bytes = block_size * plan.kv_per_token
    num_blocks = max(0, int(plan.kv_budget // block_bytes))
    per_sequence = -(-seq_len // block_size)
    return PagedMemoryPlan(block_size=block_size, block_bytes=block_bytes, num_blocks=num_blocks,
                           blocks_per_sequence=per_sequence, num_sequences=num_blocks // per_sequence,
                           wasted_slots_per_sequence=per_sequence * block_size - seq_len)
