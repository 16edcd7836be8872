"""Chapter 04 — the naive KV cache: one contiguous buffer per request, reserved up front for max_len tokens.

Without a cache, generating token t runs the model over all P + t tokens again, although the
keys and values of the first P + t - 1 tokens are exactly what the previous step computed
(a token's K and V depend only on the tokens before it, and RoPE has already rotated them
into place). The cache keeps them, and generation splits into two kinds of forward pass:

    prefill  the whole prompt at once: N = P query tokens, K/V written at positions 0 .. P-1
    decode   one token at a time:      N = 1 query token at position p, K/V written at p,
             attending to the p + 1 keys 0 .. p

Layout, for every layer, K and V of every position the request may ever reach:

    kv[layer_idx, 0 (K) or 1 (V), position, kv_head, head_dim]
    SmolLM2 fp32, max_len 2048:  30 · 2 · 2048 · 3 · 64 · 4 B = 94,371,840 B = 90 MiB,
    reserved whether the request stops after 10 tokens or after 2048 (chapter 05 fixes that).

The cache is an AttentionFn (see nanoserve/model/block.py): the model calls it once per layer with
that layer's new q, k, v; the caller says when the forward pass is over. It attends with chapter 01's
scaled_dot_product_attention, or with the one it is given (`generate --student 01`: the learner's).

    cache = NaiveKVCache(model.config, max_len=len(prompt) + max_tokens)
    hidden = model(prompt, cache.positions(len(prompt)), cache)    # prefill
    cache.advance(len(prompt))
    hidden = model(next_id, cache.positions(1), cache)              # decode: next_id is (1,)
    cache.advance(1)
"""

from typing import Callable

import torch

from nanoserve.model.attention import scaled_dot_product_attention
from nanoserve.model.config import LlamaConfig


class NaiveKVCache:
    """K and V of one request, for every layer and up to `max_len` positions."""

    def __init__(self, config: LlamaConfig, max_len: int, dtype: torch.dtype = torch.float32, device=None,
                 attention: Callable[..., torch.Tensor] = scaled_dot_product_attention):
        if not 1 <= max_len <= config.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} must be between 1 and the model's context of {config.max_position_embeddings} tokens"
            )
        self.max_len = max_len
        # chapter 01's attention, whoever wrote it: here the queries are the last N of S keys, the mask's offset at work
        self.attention = attention
        self.num_cached = 0  # positions 0 .. num_cached-1 hold K/V of finished forward passes
        self.kv = torch.zeros(  # (layers, 2, max_len, Hkv, D)
            config.num_hidden_layers, 2, max_len, config.num_key_value_heads, config.head_dim, dtype=dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        """Bytes reserved: 2 × layers × max_len × kv_heads × head_dim × bytes per element."""
        return self.kv.numel() * self.kv.element_size()

    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions of the next `num_tokens` tokens, which follow the cached ones: (num_tokens,)."""
        return torch.arange(self.num_cached, self.num_cached + num_tokens, device=self.kv.device)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V after the cached ones, then attend to all of them.

        q: (N, H, D), k, v: (N, Hkv, D) for the N new tokens at positions num_cached .. num_cached+N-1.
        Returns (N, H, D). The queries are the last N of the S = num_cached + N keys, so query i
        sees keys 0 .. num_cached + i: prefill (num_cached = 0) is plain causal attention,
        decode (N = 1) sees every key.
        """
        start, end = self.num_cached, self.num_cached + q.shape[0]
        if end > self.max_len:
            raise ValueError(
                f"cache overflow: {start} cached + {q.shape[0]} new = {end} tokens, but max_len is {self.max_len}"
            )
        self.kv[layer_idx, 0, start:end] = k
        self.kv[layer_idx, 1, start:end] = v
        keys, values = self.kv[layer_idx, 0, :end], self.kv[layer_idx, 1, :end]  # (S, Hkv, D) each
        # (N, H, D) -> (1, H, N, D) and (S, Hkv, D) -> (1, Hkv, S, D): chapter 01's batched layout.
        out = self.attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], causal=True
        )
        return out[0].transpose(0, 1)  # (N, H, D)

    def advance(self, num_tokens: int) -> None:
        """The forward pass is over: its `num_tokens` tokens now count as cached.

        Every layer wrote the same positions, so the length moves once per forward pass, not per layer.
        """
        if self.num_cached + num_tokens > self.max_len:
            raise ValueError(
                f"cache overflow: {self.num_cached} cached + {num_tokens} new tokens exceeds max_len {self.max_len}"
            )
        self.num_cached += num_tokens
