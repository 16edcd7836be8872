"""Chapter 19 — the batched LoRA product: every token adds the update of its own adapter.

The slots: each LoRA layer holds the adapters of the step stacked on a leading axis (layers.py),

    a: (num_slots, S·R, in)     the S slices' A (R = max_lora_rank, zero-padded), slot 0 all zeros: the base
    b: (num_slots, out, R)      the slices' scale·B, each in its own rows of the fused output

and a step maps each token to a slot. Punica (Chen et al., 2023) names the two shapes of that product:

BGMV, batched gather matrix-vector, for decode steps (one token per sequence): gather every token's own A and
B, then one small matrix-vector product per token — one kernel whatever the mix of adapters.

    token  slot   shrink: v = A[slot] · x       expand: y[rows of slice s] += B[slot, rows] · v[slice s]
      0     1            (S·R,)                           (out,)
      1     0      (the base: zeros in, zeros out)
      2     2

SGMV, segmented gather, for prefill chunks: the tokens of one sequence share an adapter, so each segment
[start, end) is one matrix-matrix product with its adapter's A and B — no per-token copy of the weights.

Merging (W + scale·B·A into the weights) costs nothing per step but serves one adapter per copy of the
model; the gather serves any mix, at the price of these two thin products per projection.
"""

import torch


def slice_bounds(slices: list[int]) -> list[tuple[int, int]]:
    """Output sizes of the fused parts -> their row ranges: [576, 192, 192] -> [(0, 576), (576, 768), (768, 960)]."""
    bounds, start = [], 0
    for n in slices:
        bounds.append((start, start + n))
        start += n
    return bounds


def bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
         slices: list[int]) -> torch.Tensor:
    """Gathered LoRA update of each token. x: (N, in) float32, a: (num_slots, S·R, in), b: (num_slots, out, R),
    token_slots: (N,) long -> (N, out): row t is B[s] · (A[s] · x[t]) slice by slice, with s = token_slots[t]."""
    R = b.shape[-1]
    v = torch.bmm(a[token_slots], x[:, :, None])[:, :, 0]  # shrink: (N, S·R, in) · (N, in, 1) -> (N, S·R)
    out = x.new_empty(x.shape[0], b.shape[1])
    for s, (lo, hi) in enumerate(slice_bounds(slices)):  # expand: (N, rows, R) · (N, R, 1) -> (N, rows)
        out[:, lo:hi] = torch.bmm(b[token_slots, lo:hi], v[:, s * R:(s + 1) * R, None])[:, :, 0]
    return out


def sgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: list[tuple[int, int, int]],
         slices: list[int]) -> torch.Tensor:
    """The same update by segments. segments: (start, end, slot) covering x's rows in order; rows of slot 0
    (the base) stay zero. Each segment: (n, in) · A[slot]ᵀ -> (n, S·R), then per slice · B[slot, rows]ᵀ."""
    R = b.shape[-1]
    out = x.new_zeros(x.shape[0], b.shape[1])
    for start, end, slot in segments:
        if slot == 0:
            continue
        v = x[start:end] @ a[slot].t()  # shrink: (n, S·R)
        for s, (lo, hi) in enumerate(slice_bounds(slices)):
            out[start:end, lo:hi] = v[:, s * R:(s + 1) * R] @ b[slot, lo:hi].t()  # expand: (n, rows)
    return out
