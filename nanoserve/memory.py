"""Memory math: what a model's weights (chapter 02) and its KV cache (chapter 04) cost in bytes.

Every number here is computed from a config, so it holds for any Llama-shaped model.
For SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, head_dim 64, vocab 49152, tied):

    one layer = attention (576·576 + 2·576·192 + 576·576) + MLP 3·576·1536 + 2 norms·576
              = 884,736 + 2,654,208 + 1,152 = 3,540,096
    total     = 30 · 3,540,096 + embedding 49152·576 + final norm 576 = 134,515,008
"""

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


def format_bytes(n: float) -> str:
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
