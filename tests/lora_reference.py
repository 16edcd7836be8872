"""Chapter 19's oracle: a tiny random Llama, its transformers twin, and LoRA adapters PEFT trains on it."""

import torch
from transformers.models.llama import modeling_llama

from nanoserve.model import Llama, LlamaConfig
from nanoserve.lora.train import train_adapter
from tests.hf_reference import hf_config

TINY = LlamaConfig.tiny()


def tiny_llama(seed: int = 0) -> Llama:
    """Our tiny Llama with random weights (norms near 1)."""
    model = Llama(TINY).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


def hf_twin(ours: Llama):
    """transformers' LlamaForCausalLM with the same weights."""
    theirs = modeling_llama.LlamaForCausalLM(hf_config(TINY)).eval()
    theirs.load_state_dict({("lm_head." + k[8:] if k.startswith("lm_head.") else "model." + k): v
                            for k, v in ours.state_dict().items()})
    return theirs


def train_tiny_adapters(hf_model, out_dir, specs: dict[str, dict]) -> dict[str, str]:
    """{name: train_adapter kwargs} -> {name: directory}: each adapter a few AdamW steps on its own random
    token sequences, with a large learning rate, so that its update is far from zero (PEFT starts B at 0)."""
    paths = {}
    for i, (name, kwargs) in enumerate(specs.items()):
        g = torch.Generator().manual_seed(100 + i)
        seqs = [torch.randint(0, TINY.vocab_size, (12,), generator=g).tolist() for _ in range(16)]
        paths[name] = train_adapter(hf_model, seqs, out_dir / name, steps=4, lr=2e-2, seed=i, **kwargs)
    return paths
