"""Chapter 19 — merging one adapter into the weights: W' = W + scale·B·A, once (the chapter's section 2).

    qkv_proj.weight (q + 2·kv, in)      rows [0, q)        += scale·B_q · A_q      (q, r) · (r, in)
                                        rows [q, q + kv)   += scale·B_k · A_k
                                        rows [q + kv, ...) += scale·B_v · A_v

The merged model runs at the base model's speed and serves that one adapter only; `bench lora` compares it with
the batched gather serving many. Float weights only: a quantized projection (int8, q4) would have to be
quantized again, and its rounding would change the adapter's small update.
"""

import torch
from torch import nn

from nanoserve.engine.config import LORA_MODULES
from nanoserve.lora.adapter import LoRAAdapter
from nanoserve.lora.layers import fused_slices
from nanoserve.lora.punica import slice_bounds


@torch.no_grad()
def merge_adapter(model, adapter: LoRAAdapter) -> None:
    """Add the adapter's update into `model`'s fused projections, in place (its B already carries the scale)."""
    for module, (a, b) in adapter.weights.items():  # "layers.0.self_attn.q_proj": A (r, in), scale·B (out, r)
        prefix, _, part = module.rpartition(".")
        fused = next(f for f, parts in LORA_MODULES.items() if part in parts)
        linear = model.get_submodule(f"{prefix}.{fused}")
        if not isinstance(linear, nn.Linear) or not linear.weight.is_floating_point():
            raise ValueError(f"merge_adapter: {prefix}.{fused} is a {type(linear).__name__}; only float Linear "
                             "weights can take an adapter merged in")
        lo, hi = slice_bounds(fused_slices(model, fused))[LORA_MODULES[fused].index(part)]
        linear.weight[lo:hi] += (b @ a).to(linear.weight.dtype)  # (out_part, r) · (r, in)
