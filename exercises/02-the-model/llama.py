"""Exercise 2.3 — the whole model. Your version of Llama in nanoserve/model/llama.py.

The constructor is given (the reference's): it builds the parts, which you use by these names:
`self.embed_tokens` (vocab_size × hidden_size), `self.layers` (the decoder blocks, each called as
block(x, cos, sin, attn)), `self.norm` (the final RMSNorm), `self.lm_head` (tied to the embedding when the config
says so), `self.causal_attention` (the no-cache attention function) and `self.config`. You write how a flat list
of tokens flows through them, and how hidden states become logits.
"""

import torch

from nanoserve.model.block import AttentionFn
from nanoserve.model.llama import Llama as ReferenceLlama
from nanoserve.model.rope import rope_cos_sin  # noqa: F401  (you will want it: the (N, head_dim) cos and sin tables)


class Llama(ReferenceLlama):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionFn | None = None
    ) -> torch.Tensor:
        """Exercise 2.3. input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size).

        - The tokens are a flat list with no batch axis. Each sits at its `positions` entry; without
          `positions` they are one sequence at positions 0 .. num_tokens - 1.
        - Every block gets the same RoPE tables for these positions, (num_tokens, head_dim) each, in the
          embedding's dtype, and the attention function `attn` (None: `self.causal_attention`, the no-cache one).
        - The result is the final norm's output: hidden states, not logits (see `compute_logits`).
        - Raise ValueError if input_ids is not 1-D, its message naming the shape (ids of shape (1, 4): a
          message holding "(1, 4)" or "torch.Size([1, 4])"), or if a position is at or beyond
          config.max_position_embeddings, its message naming that limit as a plain number ("512" for the tiny
          config).

        Example (LlamaConfig.tiny(): hidden_size 64, head_dim 16): model(torch.tensor([5, 9, 2])) has shape
        (3, 64). Row i depends on tokens 0..i only (the causal attention), so the first two rows equal
        model(torch.tensor([5, 9])). With positions [3, 4, 5] the rows are the same up to float rounding (a
        shift of every position keeps every distance, chapter 01); with positions [0, 2, 5] they change.
        """
        raise NotImplementedError("Exercise 2.3: embed, rotate at the given positions, run the blocks, normalise")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exercise 2.3. hidden states (N, hidden_size) -> logits (N, vocab_size): one score per vocabulary
        entry, from the LM head (the embedding matrix itself when the config ties them)."""
        raise NotImplementedError("Exercise 2.3: project hidden states to the vocabulary")
