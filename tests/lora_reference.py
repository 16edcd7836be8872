"""Chapter 19's oracle: a tiny random Llama, its transformers twin, and LoRA adapters PEFT trains on it."""

import torch
from transformers.models.llama import modeling_llama

from nanoserve.model import Llama, LlamaConfig
from nanoserve.lora.train import train_adapter
from tests.hf_reference import hf_config

TINY = LlamaConfig.tiny()
ADAPTER_SPECS = {"a": {"rank": 4, "alpha": 8}, "b": {"rank": 8, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}}


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


def peft_model(paths: dict[str, str]):
    """transformers + PEFT on the tiny model, holding every adapter of `paths` (switch with set_adapter)."""
    from peft import PeftModel

    names = list(paths)
    model = PeftModel.from_pretrained(hf_twin(tiny_llama()), paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(paths[name], adapter_name=name)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0  # never stops early
    return model.eval()


def peft_greedy(model, ids: list[int], lora: str | None, max_new_tokens: int) -> list[int]:
    """PEFT's greedy continuation of `ids` under adapter `lora` (None: the base model), EOS ignored."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    with torch.no_grad():
        if lora is None:
            with model.disable_adapter():
                out = model.generate(torch.tensor([ids]), **kw)
        else:
            model.set_adapter(lora)
            out = model.generate(torch.tensor([ids]), **kw)
    return out[0, len(ids):].tolist()
