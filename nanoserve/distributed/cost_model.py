"""Chapter 11 — a model of one tensor-parallel decode step on real GPUs, from chapter 04's byte counts.

A decode step of B sequences with S tokens of context each, on n GPUs, per GPU (b bytes per value):

    weights read   Wb / n                         W = parameters the step multiplies by (layers + LM head)
    KV read        B · S · kv_bytes_per_token / min(n, Hkv)       (past Hkv ranks the KV heads are copies)
    FLOPs          2 · W · B / n  +  4 · B · S · H · D · L / n     (matmuls; attention's QKᵀ and PV)
    all-reduce     2 per layer, each of B · hidden · b bytes; a ring all-reduce moves 2 (n−1)/n of it over
                   each GPU's link and takes 2 (n−1) latency-bound hops:  t_ar = 2(n−1)/n · bytes / link + 2(n−1) · α

    t_step = max(FLOPs / peak, (weights + KV) / HBM) + 2 L · t_ar        (no overlap: the worst case)

The first term shrinks as 1/n; the second grows with n. Decode is memory-bound (B ≪ peak/HBM ≈ 300
FLOP/B), so TP buys a share of HBM bandwidth per GPU, and pays in all-reduces whose bytes are tiny
(B · hidden · 2: 512 KiB for Llama-3-8B at B = 64) but whose latency is paid 2 L times per step.
"""

from dataclasses import dataclass

from nanoserve.memory import DTYPE_BYTES, kv_bytes_per_token, parameter_counts
from nanoserve.model.config import LlamaConfig


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    peak_flops: float
    link_bytes_per_s: float  # per GPU, one direction: what a ring all-reduce step can use
    # per ring hop: assumed, not measured (nccl-tests' all_reduce_perf measures a node's small-message latency);
    # the hops only, no kernel launch or synchronisation, so low
    link_latency_s: float
    memory_bytes: float


# H100 SXM datasheet numbers: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 80 GB; NVLink 4: 900 GB/s both
# directions (450 each); PCIe Gen5 x16: 64 GB/s each way. The latencies are assumptions, stated as such.
H100_NVLINK = Hardware("H100 + NVLink", 3.35e12, 989e12, 450e9, 2e-6, 80e9)
H100_PCIE = Hardware("H100 + PCIe 5", 3.35e12, 989e12, 64e9, 5e-6, 80e9)


@dataclass(frozen=True)
class StepCost:
    tp: int
    weight_bytes: float  # per GPU, read once per step
    kv_bytes: float  # per GPU, read once per step
    flops: float  # per GPU
    all_reduce_bytes: float  # per step, the payload of the 2 L all-reduces
    compute_s: float
    memory_s: float
    all_reduce_s: float
    fits: bool  # weights + KV within the device (minus 10 %)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.all_reduce_s


def tp_decode_step(config: LlamaConfig, tp: int, batch: int, context: int, hw: Hardware,
                   dtype: str = "bf16") -> StepCost:
    b = DTYPE_BYTES[dtype]
    counts = parameter_counts(config)
    multiplied = counts["all_layers"] + (counts["lm_head"] or counts["embedding"])  # the embedding is a lookup
    weight_bytes = multiplied * b / tp
    kv_bytes = batch * context * kv_bytes_per_token(config, dtype) / min(tp, config.num_key_value_heads)
    L, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    flops = (2 * multiplied * batch + 4 * batch * context * H * D * L) / tp
    message = batch * config.hidden_size * b
    one = 0.0 if tp == 1 else 2 * (tp - 1) / tp * message / hw.link_bytes_per_s + 2 * (tp - 1) * hw.link_latency_s
    stored = counts["total"] * b / tp + kv_bytes
    return StepCost(tp, weight_bytes, kv_bytes, flops, 2 * L * message, flops / hw.peak_flops,
                    (weight_bytes + kv_bytes) / hw.hbm_bytes_per_s, 2 * L * one, stored <= 0.9 * hw.memory_bytes)
