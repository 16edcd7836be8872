"""`python -m nanoserve bench linear`: the model's matrix products, x · Wᵀ vs (W · xᵀ)ᵀ, by batch size.

Every linear layer of SmolLM2 (30 layers × q, k, v, o, gate, up, down, then the LM head) is run once
over a batch of `tokens` rows, both ways, alternating, best of --repeats:

  x·Wᵀ       F.linear(x, W): what nn.Linear does
  (W·xᵀ)ᵀ    nanoserve.model.layers.swap_ab(x, W), what nanoserve's `Linear` does up to
             SWAP_AB_MAX_TOKENS tokens (the crossover this benchmark shows)

--bf16 adds a third column, x·Wᵀ with weights and inputs in bfloat16 (oneDNN's bf16 kernels, on AMX /
AVX512-BF16 where the CPU has them), timed in the same alternating rounds: where chapter 09's bf16 slowdown
comes from.

Each weight is a separate tensor, as in the model, so a pass streams ~540 MB of float32 weights and
none of them is still in cache from the pass before: a decode step's conditions, not a warm microbenchmark.
Freed memory is kept for reuse as in the engine's worker, so big outputs do not page-fault afresh.
"""

import time

import torch
from torch.nn import functional as F


def register(sub):
    p = sub.add_parser("linear", help="x·Wᵀ vs (W·xᵀ)ᵀ over all of the model's weights, by batch size (chapter 06)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="also time x·Wᵀ in bfloat16, beside float32 (chapter 09)")
    p.set_defaults(func=run)


def model_weights(config) -> list[torch.Tensor]:
    """Random float32 weights with the model's shapes, (out, in) each, LM head last."""
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    shapes = [(q, H), (kv, H), (kv, H), (H, q), (I, H), (I, H), (H, I)] * config.num_hidden_layers
    return [torch.randn(shape) for shape in shapes + [(config.vocab_size, H)]]


def linear_pass(weights, inputs, product) -> float:
    """Seconds to multiply every weight by its input (inputs: in_features -> (tokens, in_features))."""
    t0 = time.perf_counter()
    for W in weights:
        product(inputs[W.shape[1]], W)
    return time.perf_counter() - t0


@torch.inference_mode()
def run(args):
    from nanoserve.engine.worker import keep_freed_host_memory
    from nanoserve.model.config import LlamaConfig
    from nanoserve.model.layers import swap_ab

    keep_freed_host_memory()
    weights = model_weights(LlamaConfig())  # SmolLM2-135M's shapes
    flop_per_token = 2 * sum(W.numel() for W in weights)
    bf16 = [W.bfloat16() for W in weights] if args.bf16 else None
    print(f"command: python -m nanoserve bench linear --tokens {' '.join(map(str, args.tokens))} --repeats {args.repeats}"
          + (" --bf16" if args.bf16 else ""))
    print(f"threads: {torch.get_num_threads()}, float32, {len(weights)} weight matrices, "
          f"{sum(W.numel() for W in weights) * 4 / 2**20:.0f} MiB")
    print(f"{'tokens':>7s} {'x·Wᵀ ms':>10s} {'(W·xᵀ)ᵀ ms':>12s} {'x·Wᵀ GFLOP/s':>14s} {'(W·xᵀ)ᵀ GFLOP/s':>17s} {'speed-up':>9s}"
          + (f" {'bf16 x·Wᵀ ms':>13s} {'bf16 / fp32':>11s}" if bf16 else ""))
    for tokens in args.tokens:
        inputs = {n: torch.randn(tokens, n) for n in {W.shape[1] for W in weights}}
        inputs16 = {n: x.bfloat16() for n, x in inputs.items()} if bf16 else None
        plain = swapped = half = float("inf")
        for _ in range(args.repeats + 1):  # alternating, so drifts in machine speed hit all; round 1 warms up
            plain = min(plain, linear_pass(weights, inputs, F.linear))
            swapped = min(swapped, linear_pass(weights, inputs, swap_ab))
            if bf16:
                half = min(half, linear_pass(bf16, inputs16, F.linear))
        flop = flop_per_token * tokens
        print(f"{tokens:7d} {plain * 1e3:10.1f} {swapped * 1e3:12.1f} {flop / plain / 1e9:14.1f} "
              f"{flop / swapped / 1e9:17.1f} {plain / swapped:8.2f}x"
              + (f" {half * 1e3:13.1f} {half / plain:10.2f}x" if bf16 else ""))
