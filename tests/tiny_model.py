"""The tiny random-weight Llama the engine-level tests serve (fast, and the real code paths end to end)."""

import time

import torch

from nanoserve.model import Llama, LlamaConfig


def tiny_llama(model_class=Llama, **config) -> Llama:
    """LlamaConfig.tiny(**config) with seeded weights and HF's embedding init (std 0.02): with N(0, 1)
    embeddings the tied LM head just repeats the last token, so greedy outputs would not vary."""
    torch.manual_seed(0)
    model = model_class(LlamaConfig.tiny(**config)).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
    return model


class PacedLlama(Llama):
    """The tiny model with a forward pass of at least `delay_s` seconds, as a real model's step on a CPU: chapter
    16's fleet tests need a stream that lasts (to kill its replica mid-way) and a burst that keeps replicas busy."""
    delay_s = 0.0

    def forward(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return super().forward(*args, **kwargs)


def paced_tiny_llama(delay_s: float, **config) -> PacedLlama:
    """tiny_llama(**config) (the same weights) whose every step takes at least delay_s."""
    model = tiny_llama(PacedLlama, **config)
    model.delay_s = delay_s
    return model
