"""Chapter 01 — rotary position embeddings (RoPE), in the rotate-half form HF Llama uses.

Each head vector x of size D is cut into two halves (x1, x2) and pair (x1[i], x2[i])
is rotated by the angle  position * theta_i,  with  theta_i = base ** (-2i / D).
Low i spin fast (fine position), high i spin slowly (coarse position).

Because a rotation by a and one by b leave a dot product depending only on a - b,
q·k after RoPE depends on the *distance* between two tokens, not where they sit.
That is also why the KV cache can store K already rotated: a key's rotation never changes.
"""

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, each (*positions.shape, head_dim)."""
    # theta_i, made where the positions are (a GPU's, for a model on cuda: a CPU table would not broadcast)
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., D): the same angle for x1[i] and x2[i]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1): a 90° turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., num_tokens, num_heads, head_dim) by the angles in cos/sin (..., num_tokens, head_dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return x * cos + rotate_half(x) * sin
