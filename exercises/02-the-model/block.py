"""Exercise 2.2 — the decoder block. Your version of DecoderBlock in nanoserve/model/block.py.

The sub-layers are given (under `make grade`, the reference RMSNorm, attention and MLP, so this exercise
does not depend on 2.1; served with `--student 02`, the norms are your finished RMSNorm); you write how data
flows through them.
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
        """Exercise 2.2. x: (num_tokens, hidden) -> (num_tokens, hidden), a pre-norm block (chapter 02, section 4).

        - Two sub-layers, attention first, then the MLP. Each reads a *normalised* copy of the residual stream
          (its own RMSNorm: input_layernorm before attention, post_attention_layernorm before the MLP) and its
          output is *added* to the stream. The stream itself is never normalised.
        - self_attn takes (its normalised input, cos, sin, attn) and returns (num_tokens, hidden); the MLP sees
          the stream as the attention sub-layer left it.
        - Invariant: with o_proj and down_proj all zeros, both sub-layers add nothing and the block returns x.
        """
        raise NotImplementedError("Exercise 2.2: the two pre-norm residual sub-layers of a Llama block")
