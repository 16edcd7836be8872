"""Chapter 19 — the fused projections an adapter may touch (nanoserve/model/stacked.py), and the checkpoint's
names of the parts each one stacks: an adapter's q_proj lands in the first slice of qkv_proj."""

LORA_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
