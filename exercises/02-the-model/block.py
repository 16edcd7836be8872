"""Exercise 2.2 — the decoder block. Your version of DecoderBlock in nanoserve/model/block.py.

The sub-layers are given (the reference RMSNorm, attention and MLP, so this exercise does not
depend on 2.1); you write how data flows through them.
"""

import torch
from torch import nn

from nanoserve.model.block import AttentionFn, LlamaAttention
from nanoserve.model.config import LlamaConfig
from nanoserve.model.layers import MLP, RMSNorm


class DecoderBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden). A pre-norm block:

            h   = x + self_attn(input_layernorm(x), cos, sin, attn)
            out = h + mlp(post_attention_layernorm(h))
        """
        raise NotImplementedError("Exercise 2.2: the two pre-norm residual sub-layers of a Llama block")
