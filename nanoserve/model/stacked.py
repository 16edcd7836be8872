"""Fused projections — several Linear layers that read the same input, stacked into one weight.

Attention's q, k and v all multiply the same normalised x, and so do the MLP's gate and up. Stacked along
the output features they become ONE product (vLLM's QKVParallelLinear and MergedColumnParallelLinear):

    qkv_proj.weight     = cat([q_proj.weight, k_proj.weight, v_proj.weight])   (H·D + 2·Hkv·D, hidden)
    gate_up_proj.weight = cat([gate_proj.weight, up_proj.weight])              (2 · intermediate, hidden)

    q, k, v  = qkv_proj(x).split([H·D, Hkv·D, Hkv·D], dim=-1)     the same numbers as three products
    gate, up = gate_up_proj(x).chunk(2, dim=-1)

Each output row is the same dot product either way; what changes is the number of products, 4 per layer
instead of 7, and one GEMM reads x once instead of three times. That can pay where each product has a fixed
cost, as a GPU's kernel launch (not measured in this course). On the 2-core VM chapter 02 measured (section 4;
its CPU kind was not recorded) it bought no measurable time in float32: `python -m nanoserve bench linear --fused`
timed the separate and the fused products within noise of each other. The layout is kept because it is vLLM's, whose tensor-parallel layers
shard the stacked weights as chapter 11's do.

Checkpoints (HF's, the GGUF's) store the parts. `STACKED_PARAMS` maps the fused name to its parts, and
`stack_parts` makes a module's state_dict speak the checkpoint's names: saving splits the fused weight into
its parts, loading concatenates them. So `hf_model.load_state_dict(ours.state_dict())` works both ways.
"""

from typing import Callable

import torch
from torch import nn

# fused layer -> the checkpoint's layers it stacks, in row order (vLLM's stacked_params_mapping)
STACKED_PARAMS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_name(module_name: str) -> tuple[str, int] | None:
    """"layers.3.self_attn.k_proj" -> ("layers.3.self_attn.qkv_proj", 1): the fused layer a checkpoint's
    layer is part of, and which part; None for a layer that is not stacked."""
    prefix, _, layer = module_name.rpartition(".")
    for fused, parts in STACKED_PARAMS.items():
        if layer in parts:
            return f"{prefix}.{fused}" if prefix else fused, parts.index(layer)
    return None


def fuse_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{module name: tensor} with the checkpoint's parts -> the same with each set of parts concatenated
    (dim 0) under the fused name. Any tensor whose dim 0 is the output feature works: float or int8
    weights, a GGUF's rows of Q4_1 blocks (out, in/32, 20). Example: {"mlp.gate_proj": (1536, 18, 20),
    "mlp.up_proj": (1536, 18, 20)} -> {"mlp.gate_up_proj": (3072, 18, 20)}."""
    groups: dict[str, list] = {}
    out = {}
    for name, t in tensors.items():
        found = fused_name(name)
        if found is None:
            out[name] = t
        else:
            groups.setdefault(found[0], [None] * len(STACKED_PARAMS[found[0].rpartition(".")[2]]))[found[1]] = t
    for name, parts in groups.items():
        if any(p is None for p in parts):
            raise ValueError(f"{name}: the checkpoint holds only some of its parts "
                             f"{STACKED_PARAMS[name.rpartition('.')[2]]}")
        out[name] = torch.cat(parts)
    return out


def stack_parts(module: nn.Module, fused: str, sizes: Callable[[torch.Tensor], list[int]]) -> None:
    """Make `module.state_dict()` store `module.<fused>.weight` as its STACKED_PARAMS parts (rows split by
    `sizes(weight)`), and `module.load_state_dict` accept the parts. A quantized fused layer holds no parameter
    (its tensors are non-persistent buffers), so there is then nothing to split."""
    parts = STACKED_PARAMS[fused]

    def save(mod, state, prefix, local_metadata):
        key = f"{prefix}{fused}.weight"
        if key in state:
            for part, w in zip(parts, (w := state.pop(key)).split(sizes(w))):
                state[f"{prefix}{part}.weight"] = w

    def load(mod, state, prefix, *args):
        keys = [f"{prefix}{part}.weight" for part in parts]
        if all(k in state for k in keys):
            state[f"{prefix}{fused}.weight"] = torch.cat([state.pop(k) for k in keys])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
