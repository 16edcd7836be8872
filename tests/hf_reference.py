"""Build transformers' Llama pieces with the same numbers as ours: the independent oracle."""

import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama import modeling_llama

from nanoserve.model import LlamaConfig


def hf_config(config: LlamaConfig) -> HFLlamaConfig:
    hf = HFLlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
    )
    hf._attn_implementation = "eager"
    return hf


def hf_rope(config: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for positions (T,), each (1, T, head_dim)."""
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_config(config))
    return rotary(torch.zeros(1, dtype=torch.float32), positions[None])


def additive_causal_mask(T: int) -> torch.Tensor:
    """(1, 1, T, T): 0 on and below the diagonal, -inf above — written independently of ours."""
    return torch.full((T, T), float("-inf")).triu(1)[None, None]
