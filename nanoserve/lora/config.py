"""Chapter 19 — the LoRA settings, one dataclass (vLLM's LoRAConfig), held by EngineConfig as `lora_config`."""

from dataclasses import dataclass

# the fused projections an adapter may touch (nanoserve/model/stacked.py), and the checkpoint's names in each
LORA_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRAConfig:
    max_loras: int = 4  # adapters one step may hold (slots in the LoRA layers' weights)
    max_lora_rank: int = 16  # every slot is this rank wide; an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept in memory outside the slots (None: max_loras); the rest: disk
    modules: tuple[str, ...] = tuple(LORA_MODULES)  # the fused projections that get LoRA layers

    def __post_init__(self):
        self.modules = tuple(self.modules)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoRAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                             "an adapter in a slot is also kept in memory")
        unknown = [m for m in self.modules if m not in LORA_MODULES]
        if unknown:
            raise ValueError(f"unknown LoRA modules {unknown}; known: {', '.join(LORA_MODULES)}")
