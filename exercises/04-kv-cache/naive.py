"""Exercise 4.1 — the naive KV cache: write this layer's K/V, then attend over everything cached.

Your version of nanoserve/kv/naive.py. The class inherits the constructor, `nbytes`, `positions`
and `advance` of the reference, so you write the heart of it only: `__call__`, which the model
calls once per layer with that layer's new q, k, v. Then run `make grade CH=04`.

What the constructor sets up for you:

    self.kv          torch.zeros(layers, 2, max_len, Hkv, D): kv[layer_idx, 0] is K, kv[layer_idx, 1] is V
    self.max_len     positions the cache can hold
    self.num_cached  positions 0 .. num_cached-1 hold K/V of earlier forward passes;
                     `advance(N)` adds N after each forward pass (not your job in __call__)
    self.attention   chapter 01's scaled_dot_product_attention(q, k, v, causal) on (B, H, T, D) and
                     (B, Hkv, S, D): the reference's, or yours under `generate --student 01,04`

How the tests drive it:

    cache = NaiveKVCache(model.config, max_len=len(prompt) + max_tokens)
    hidden = model(prompt, cache.positions(len(prompt)), cache)    # prefill: N = len(prompt)
    cache.advance(len(prompt))
    hidden = model(next_id, cache.positions(1), cache)              # decode: N = 1
    cache.advance(1)
"""

import torch

from nanoserve.kv.naive import NaiveKVCache as ReferenceNaiveKVCache


class NaiveKVCache(ReferenceNaiveKVCache):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exercise 4.1. Store this layer's new K/V after the cached ones, then attend to all of them.

        q: (N, H, D), k, v: (N, Hkv, D) for the N new tokens at positions num_cached .. num_cached+N-1.
        Returns (N, H, D).

        Contract:
        - afterwards self.kv[layer_idx, 0] (K) and self.kv[layer_idx, 1] (V) hold this call's k and v at
          positions num_cached .. num_cached+N-1; every other position is as it was; num_cached is unchanged
          (the caller advances it once per forward pass, after all layers);
        - output row i is query i's attention over the keys and values of positions 0 .. num_cached + i
          (S = num_cached + N keys in all), exactly what chapter 01's attention (self.attention) computes for
          that row;
        - num_cached + N > max_len raises ValueError naming both numbers (the tokens needed, and max_len),
          before anything is written.

        Example: num_cached = 41, N = 1 (a decode step) -> K/V written at position 41, the query attends to
        42 keys. num_cached = 0, N = 41 (the prefill) -> plain causal attention over the 41 tokens.
        """
        raise NotImplementedError("Exercise 4.1: return (N, H, D), row i attending over positions 0 .. num_cached + i "
                                  "of this layer, this call's k/v included")
