"""The tiny random-weight Llama the engine-level tests serve (fast, and the real code paths end to end)."""

import torch

from nanoserve.model import Llama, LlamaConfig


def tiny_llama(**config) -> Llama:
    """LlamaConfig.tiny(**config) with seeded weights and HF's embedding init (std 0.02): with N(0, 1)
    embeddings the tied LM head just repeats the last token, so greedy outputs would not vary."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny(**config)).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
    return model
