"""Chapter 02 — the Llama model: embedding, N decoder blocks, a final norm, and the LM head.

    ids (N,) -> embed (N, hidden) -> block × L -> norm -> lm_head -> logits (N, vocab)

`forward` returns hidden states and `compute_logits` projects them to the vocabulary, as vLLM
splits it: a server needs logits only for each sequence's last token, and the LM head of a
small model is a large share of its work (for SmolLM2: 49152 × 576 = 28M of 135M weights).
"""

import functools
import importlib

import torch
from torch import nn

from nanoserve.model.attention import scaled_dot_product_attention
from nanoserve.model.block import AttentionFn
from nanoserve.model.config import LlamaConfig
from nanoserve.model.layers import Linear
from nanoserve.model.rope import rope_cos_sin


def causal_self_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sdpa=scaled_dot_product_attention) -> torch.Tensor:
    """The no-cache attention: all N tokens are one sequence and attend causally to each other."""
    # (N, H, D) -> (1, H, N, D) for the batched attention of chapter 01, and back.
    out = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    return out[0].transpose(0, 1)  # (N, H, D)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, modules=importlib.import_module):
        """`modules(name)` gives the module each part is built from: nanoserve.model.block (DecoderBlock),
        .layers (the final RMSNorm) and .attention (the no-cache attention). The default is the reference;
        `--student 01,02` passes StudentCode.module, which gives the learner's finished files instead."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        block = modules("nanoserve.model.block").DecoderBlock
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_hidden_layers))
        self.norm = modules("nanoserve.model.layers").RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the attention used when the caller passes none (no cache): chapter 01's, whoever wrote it
        self.causal_attention = functools.partial(
            causal_self_attention, sdpa=modules("nanoserve.model.attention").scaled_dot_product_attention)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one matrix read both ways

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionFn | None = None
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden).

        Without `positions` and `attn` the tokens are one sequence starting at position 0.
        """
        if input_ids.dim() != 1:
            raise ValueError(f"Llama.forward takes a flat (num_tokens,) tensor of ids, got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context of {self.config.max_position_embeddings} tokens"
            )
        x, cos, sin = self.embed(input_ids, positions)
        for block in self.layers:
            x = block(x, cos, sin, attn or self.causal_attention)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """ids, positions (N,) -> x (N, hidden) and the RoPE tables cos, sin (N, D)."""
        x = self.embed_tokens(input_ids)  # (N, hidden)
        # angles computed in float32, applied in the model's dtype (a bf16 model keeps bf16 q and k)
        cos, sin = (t.to(x.dtype) for t in rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta))  # (N, D)
        return x, cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (N, hidden) -> (N, vocab)
