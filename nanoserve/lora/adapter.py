"""Chapter 19 — reading a LoRA adapter in PEFT's format, and checking it fits the base model.

    my-adapter/
      adapter_config.json          {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], ...}
      adapter_model.safetensors    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight  (r, in)
                                   base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight  (out, r)

PEFT names the checkpoint's projections (q_proj, gate_proj, ...), not nanoserve's fused ones; the LoRA layers
(layers.py) place each part into its slice of qkv_proj or gate_up_proj. The scale alpha / r (alpha / √r with
rsLoRA) is folded into B here, once, so a step multiplies by nothing more.

Everything an adapter might ask that nanoserve does not do is refused with a ValueError naming it: a rank
above max_lora_rank, a module outside the model's projections (lm_head, embed_tokens), DoRA, biases,
`modules_to_save`, per-module ranks.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.lora.modules import LORA_MODULES

# "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" -> ("layers.3.self_attn.q_proj", "A")
_KEY = re.compile(r"^base_model\.model\.model\.(layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight$")
_PART_TO_FUSED = {part: fused for fused, parts in LORA_MODULES.items() for part in parts}


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # the checkpoint's module name ("layers.0.self_attn.q_proj") -> (A (r, in), scaling · B (out, r)), float32
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """r·(in + out) floats per projection it adapts, 4 bytes each."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each checkpoint projection of a Llama config. SmolLM2: q_proj (576, 576), k_proj (576, 192)..."""
    h, q, kv, i = (config.hidden_size, config.num_attention_heads * config.head_dim,
                   config.num_key_value_heads * config.head_dim, config.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_adapter_config(path: Path) -> dict:
    file = path / "adapter_config.json"
    if not path.is_dir() or not file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter directory (no adapter_config.json)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, only LORA adapters are served")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, off) != off:
            raise ValueError(f"{path}: {key}={config[key]!r} is not supported (only {key}={off!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is not supported (adapters with one rank and alpha on projections only)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in _PART_TO_FUSED]
        if unknown:
            raise ValueError(f"{path}: target modules {unknown} are not projections of this model "
                             f"(known: {', '.join(_PART_TO_FUSED)})")
    return config


def load_adapter(name: str, path: str | Path, model_config, max_rank: int,
                 modules: tuple[str, ...] = tuple(LORA_MODULES)) -> LoRAAdapter:
    """Read the adapter at `path` for a model of `model_config` (a LlamaConfig); ValueError if it does not fit.
    modules: the fused projections that have LoRA layers (LoRAConfig.modules)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_adapter_config(path)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"{path}: rank {rank} is above max_lora_rank={max_rank}" if rank > max_rank
                         else f"{path}: rank {rank} must be >= 1")
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors")
    try:
        tensors = load_file(file)
    except Exception as e:  # noqa: BLE001 — a corrupt file is the caller's bad input
        raise ValueError(f"{file}: cannot read it ({e})") from None
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = module_shapes(model_config)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{file}: tensor {key!r} is not a LoRA A or B of a projection of this model")
        found.setdefault(m.group(1), {})[m.group(2)] = t.float()
    weights = {}
    for module, ab in sorted(found.items()):
        layer, part = int(module.split(".")[1]), module.rpartition(".")[2]
        if part not in _PART_TO_FUSED or layer >= model_config.num_hidden_layers:
            raise ValueError(f"{path}: target module {module} is not in this model")
        if _PART_TO_FUSED[part] not in modules:
            raise ValueError(f"{path}: target module {module} is in {_PART_TO_FUSED[part]}, which has no LoRA layer "
                             f"(LoRA modules: {', '.join(modules)})")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {module} has lora_{''.join(ab)} only")
        (d_in, d_out), a, b = shapes[part], ab["A"], ab["B"]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise ValueError(f"{path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                             f"({rank}, {d_in}) and ({d_out}, {rank}) for rank {rank}")
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return LoRAAdapter(name, str(path), rank, scaling, weights)
