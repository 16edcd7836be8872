"""Chapter 02 — one decoder block: pre-norm attention and pre-norm MLP, each around a residual.

    q, k, v = qkv_proj(n1(x)).split(...)          one product for the three (nanoserve/model/stacked.py)
    h   = x + o_proj(attention(rope(q), rope(k), v))
    out = h + mlp(n2(h))

The block works on a flat list of tokens (num_tokens, hidden), the way serving engines do:
which tokens belong to which sequence, and which cached keys they may see, is the business
of the `attn` function passed in. The block computes q, k, v and hands them over, so the same
block runs without a cache (chapter 02), with a contiguous cache (04) and a paged one (05).
"""

from typing import Callable

import torch
from torch import nn

from nanoserve.model.config import LlamaConfig
from nanoserve.model.layers import MLP, Linear, RMSNorm
from nanoserve.model.rope import apply_rope
from nanoserve.model.stacked import stack_parts

# attn(layer_idx, q, k, v) -> out
#   q: (num_tokens, num_heads, head_dim)   k, v: (num_tokens, num_kv_heads, head_dim)
#   out: (num_tokens, num_heads, head_dim)
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # q, k and v in one weight, rows [q: H·D | k: Hkv·D | v: Hkv·D]; state_dict names q_proj, k_proj, v_proj
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        stack_parts(self, "qkv_proj", lambda w: [self.q_size, self.kv_size, self.kv_size])

    @property
    def q_size(self) -> int:  # features of q (a tensor-parallel shard changes num_heads, see shard.py)
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (num_tokens, hidden) -> q (N, H, D), k and v (N, Hkv, D), q and k rotated."""
        N = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views, no copy
        q = q.view(N, self.num_heads, self.head_dim)  # (N, H, D)
        k = k.view(N, self.num_kv_heads, self.head_dim)  # (N, Hkv, D)
        v = v.view(N, self.num_kv_heads, self.head_dim)  # (N, Hkv, D), a strided view of the product
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        out = attn(self.layer_idx, *self.qkv(x, cos, sin))  # (N, H, D)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class DecoderBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        # x: (num_tokens, hidden). Pre-norm: normalise what goes *into* each sub-layer,
        # and let the residual stream carry the un-normalised sum from block to block.
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    # The same block cut at its attention, for a compiled step (nanoserve/model/compiled.py): everything but
    # the attention is element-wise work and products, which torch.compile fuses into one graph per half.
    #   forward(x) == attention_output(x, attn(layer_idx, *attention_input(x)))
    def attention_input(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (N, hidden) -> q (N, H, D), k, v (N, Hkv, D): the norm, the qkv product, RoPE."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def attention_output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x (N, hidden) and the attention's out (N, H, D) -> the block's output (N, hidden)."""
        h = x + self.self_attn.o_proj(out.reshape(x.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))
