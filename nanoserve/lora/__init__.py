"""Chapter 19 — many LoRA adapters on one base model, batched in one step.

A LoRA adapter (Hu et al., 2021) fine-tunes a frozen projection W (out, in) by a low-rank update:

    y = x·Wᵀ + scale · (x·Aᵀ)·Bᵀ          A: (r, in)   B: (out, r)   scale = lora_alpha / r

so an adapter costs r·(in + out) numbers per projection instead of in·out. Files in PEFT's format
(adapter_config.json + adapter_model.safetensors) are read by adapter.py; layers.py wraps the model's fused
projections so that each token adds the update of *its own* adapter (a gather by adapter slot, punica.py);
manager.py keeps adapters in tiers — `max_loras` in the step's slots, `max_cpu_loras` in memory, the rest
on disk — evicting the least recently used; merge.py merges one adapter into the weights instead (the baseline
`bench lora` measures the gather against). The settings are nanoserve/engine/config.py's LoRAConfig (vLLM's).
"""
