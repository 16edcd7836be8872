"""Chapter 19 — LoRA layers: a fused projection plus the batched update of the step's adapters.

    LoRALinear(base)(x) = base(x) + update(x)      update: punica.py's bgmv (decode steps) or sgmv (the rest)

`base` is whatever the weights format made of the projection (Linear, Int8Linear, Q4Linear, BF16Linear): the
update never touches it, so every format serves adapters, and it is computed in float32 and added in the
base's output dtype. All LoRA layers of a model read one LoRAMapping, which the worker sets before each step
(which token uses which slot) and clears after it; with no adapter in the step the layers are the base alone.
"""

import torch
from torch import nn

from nanoserve.engine.config import LORA_MODULES
from nanoserve.lora import punica as reference_punica
from nanoserve.lora.adapter import module_shapes
from nanoserve.lora.punica import slice_bounds


class LoRAMapping:
    """The step's tokens -> slots (vLLM's LoRAMapping and PunicaWrapper in one). Slot 0 is the base model."""

    def __init__(self, punica=None):
        self.punica = punica or reference_punica  # whose bgmv / sgmv (the learner's under --student 19)
        self.clear()

    def set(self, rows: list[tuple[int, int]], device: torch.device | str = "cpu") -> None:
        """rows: (slot, num_tokens) of each sequence of the step, in the batch's order; device: the LoRA weights'
        (token_slots goes there once per step, not once per layer)."""
        self.token_slots = torch.tensor([slot for slot, n in rows for _ in range(n)], dtype=torch.long, device=device)
        self.segments, start = [], 0
        for slot, n in rows:
            if self.segments and self.segments[-1][2] == slot:  # neighbours of one adapter: one segment
                self.segments[-1] = (self.segments[-1][0], start + n, slot)
            else:
                self.segments.append((start, start + n, slot))
            start += n
        self.decode = all(n == 1 for _, n in rows)
        self.active = any(slot for slot, _ in rows)

    def clear(self) -> None:
        self.token_slots, self.segments, self.decode, self.active = None, [], False, False

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: list[int]) -> torch.Tensor:
        if x.shape[0] != len(self.token_slots):
            raise RuntimeError(f"the LoRA mapping covers {len(self.token_slots)} tokens, the layer got {x.shape[0]}")
        if self.decode:
            return self.punica.bgmv(x, a, b, self.token_slots, slices)
        return self.punica.sgmv(x, a, b, self.segments, slices)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slices: list[int], in_features: int, max_loras: int, max_rank: int,
                 mapping: LoRAMapping):
        super().__init__()
        self.base_layer = base  # PEFT's name for the frozen projection
        self.slices = slices  # output sizes of the fused parts: [q, k, v], [gate, up] or [out]
        self.mapping = mapping
        device = next(iter([*base.parameters(), *base.buffers()])).device  # a quantized base holds only buffers
        # slot 0 stays zero: the base model's rows gather a zero update
        self.register_buffer("lora_a", torch.zeros(max_loras + 1, len(slices) * max_rank, in_features, device=device),
                             persistent=False)  # (slots, S·R, in)
        self.register_buffer("lora_b", torch.zeros(max_loras + 1, sum(slices), max_rank, device=device),
                             persistent=False)  # (slots, out, R)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: parts[s] = (A (r, in), scale·B (out_s, r)) of slice s, None where the
        adapter leaves that part alone (its update is zero)."""
        R = self.lora_b.shape[-1]
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for s, (part, (lo, hi)) in enumerate(zip(parts, slice_bounds(self.slices))):
            if part is not None:
                a, b = part
                self.lora_a[slot, s * R:s * R + a.shape[0]] = a
                self.lora_b[slot, lo:hi, :b.shape[1]] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        y = self.base_layer(x)
        if not self.mapping.active:
            return y
        return y + self.mapping.apply(x.float(), self.lora_a, self.lora_b, self.slices).to(y.dtype)


def fused_slices(model, fused: str) -> list[int]:
    """Output sizes of a fused projection's parts, from the model's config (a TP shard is refused upstream):
    SmolLM2's qkv_proj [576, 192, 192], gate_up_proj [1536, 1536]."""
    shapes = module_shapes(model.config)
    return [shapes[part][1] for part in LORA_MODULES[fused]]


def add_lora_layers(model, modules: tuple[str, ...], max_loras: int, max_rank: int,
                    mapping: LoRAMapping) -> dict[str, LoRALinear]:
    """Wrap each fused projection named in `modules` of every decoder layer in a LoRALinear, in place (as
    quantize_model swaps its layers); returns {module name: LoRALinear}, e.g. "layers.0.self_attn.qkv_proj"."""
    shapes = module_shapes(model.config)
    wrapped = {}
    for name, module in list(model.named_modules()):
        parent, _, attr = name.rpartition(".")
        if attr in modules and attr in LORA_MODULES and not isinstance(module, LoRALinear):
            in_features = shapes[LORA_MODULES[attr][0]][0]  # the parts of a fused projection share its input
            layer = LoRALinear(module, fused_slices(model, attr), in_features, max_loras, max_rank, mapping)
            setattr(model.get_submodule(parent), attr, layer)
            wrapped[name] = layer
    return wrapped
