"""`python -m nanoserve bench linear`: the model's matrix products, x · Wᵀ vs (W · xᵀ)ᵀ, by batch size.

Every weight matrix of SmolLM2 as the model multiplies it (30 layers × the fused qkv_proj, o_proj, the fused
gate_up_proj and down_proj, then the LM head: 121 matrices, nanoserve/model/stacked.py) is run once over a
batch of `tokens` rows, both ways, best of --repeats rounds after an untimed warm-up round, the order of the
ways reversed from one round to the next (best_of):

  x·Wᵀ       F.linear(x, W): what nn.Linear does
  (W·xᵀ)ᵀ    nanoserve.model.layers.swap_ab(x, W), what nanoserve's `Linear` does up to
             SWAP_AB_MAX_TOKENS tokens (the crossover this benchmark measures)

--bf16 adds a third column, x·Wᵀ with weights and inputs in bfloat16 (oneDNN's bf16 kernels, on AMX /
AVX512-BF16 where the CPU has them), timed in the same alternating rounds: where chapter 09's bf16 slowdown
comes from.

Each weight is a separate tensor, as in the model, so a pass streams ~538 MB of float32 weights and
none of them is still in cache from the pass before: a decode step's conditions, not a warm microbenchmark.
Freed memory is kept for reuse as in the engine's worker, so big outputs do not page-fault afresh.

With --formats the same pass runs through the model's own layer classes, fused shapes (qkv_proj,
o_proj, gate_up_proj, down_proj × 30, LM head), one column per way of multiplying:

  fp32        Linear (swap AB up to SWAP_AB_MAX_TOKENS)
  bf16        BF16Linear: bf16 weights, oneDNN's bf16 GEMM (AMX tiles where the CPU has them; emulated, slower
              than float32, where it has no native bf16)
  int8, q4    torch's integer kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu), bf16 activations
  int8 dot, q4 dot   the same weights through cpu_dot.c, llama.cpp's integer dot products with the activations
              rounded to int8 (chapter 10; where gcc builds it)
  int8→bf16, q4→bf16   dequantize the weight for this call, then the GEMM, in quant.LARGE_STEP_DTYPE: bf16 where
              the CPU multiplies bf16 natively, else float32 (the columns are named int8→fp32, q4→fp32 there)
              (large_step_weights="dequantize"; "copy" costs what the bf16 or fp32 column does)

The row where the bf16 GEMM overtakes the integer kernel is this CPU's crossover; quant.KERNEL_CROSSOVER_TOKENS (16)
is a default, and LLM(kernel_crossover_tokens=...) sets another.
--fused compares the fused products with the separate q, k, v, gate, up ones in float32 and bf16.
"""

import time

import torch
from torch.nn import functional as F


def register(sub):
    p = sub.add_parser("linear", help="x·Wᵀ vs (W·xᵀ)ᵀ over all of the model's weights, by batch size (chapter 06)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--formats", nargs="+", choices=["fp32", "bf16", "int8", "q4"],
                   help="time the model's layer classes per weight format instead (the kernel crossover)")
    p.add_argument("--fused", action="store_true", help="fused qkv / gate_up products vs separate ones")
    p.add_argument("--bf16", action="store_true", help="also time x·Wᵀ in bfloat16, beside float32 (chapter 09)")
    p.set_defaults(func=run)


def best_of(passes: dict, repeats: int) -> dict:
    """{key: best seconds} of `passes` ({key: a function that runs one pass and returns its seconds}) over `repeats`
    rounds after an untimed warm-up round. Each round runs every pass once, in the order of the round before
    reversed, so no pass always runs first and a drift in the machine's speed hits them all."""
    best = dict.fromkeys(passes, float("inf"))
    order = list(passes)
    for round_ in range(repeats + 1):
        order.reverse()
        for key in order:
            seconds = passes[key]()
            if round_:  # round 0 warms up: lazy set-up, first allocations
                best[key] = min(best[key], seconds)
    return best


def linear_pass(weights, inputs, product) -> float:
    """Seconds to multiply every weight by its input (inputs: in_features -> (tokens, in_features))."""
    t0 = time.perf_counter()
    for W in weights:
        product(inputs[W.shape[1]], W)
    return time.perf_counter() - t0


def layers_pass(layers, inputs) -> float:
    """Seconds to run every layer (a Linear module) on its input, as linear_pass does with bare weights."""
    t0 = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - t0


def fused_weights(config, fused: bool = True) -> list[torch.Tensor]:
    """Random float32 weights, (out, in) each, LM head last: the model's layout (q, k, v stacked into one matrix,
    gate and up into one), or with fused=False each projection apart (what --fused compares)."""
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    shapes = [(q + 2 * kv, H), (H, q), (2 * I, H), (H, I)] if fused else [(q, H), (kv, H), (kv, H), (H, q),
                                                                            (I, H), (I, H), (H, I)]
    return [torch.randn(shape) * 0.02 for shape in shapes * config.num_hidden_layers + [(config.vocab_size, H)]]


def random_q4_blocks(out: int, inp: int) -> torch.Tensor:
    """Q4_1 blocks (out, in/32, 20) of random nibbles with small float16 d and m (a layer's shape, not its values)."""
    from nanoserve.model.quant import Q4_1_BLOCK_BYTES, Q4_GROUP_SIZE

    blocks = torch.randint(0, 256, (out, inp // Q4_GROUP_SIZE, Q4_1_BLOCK_BYTES), dtype=torch.uint8)
    dm = (torch.rand(out, inp // Q4_GROUP_SIZE, 2) * 0.01).to(torch.float16)
    blocks[..., :4] = dm.view(torch.uint8).view(out, inp // Q4_GROUP_SIZE, 4)
    return blocks


def format_layers(weights: list[torch.Tensor], fmt: str) -> dict[str, list]:
    """{column: layers} for one format; the integer formats give three columns, torch's kernel, cpu_dot.c's
    (where it builds) and dequantize → the large-step GEMM (in quant.LARGE_STEP_DTYPE)."""
    from nanoserve.kernels import cpu_dot
    from nanoserve.model.layers import Linear
    from nanoserve.model.quant import LARGE_STEP_DTYPE, BF16Linear, Int8Linear, Q4Linear

    if fmt == "fp32":
        layers = []
        for W in weights:
            layer = Linear(W.shape[1], W.shape[0])
            layer.weight.data = W
            layers.append(layer)
        return {"fp32": layers}
    if fmt == "bf16":
        return {"bf16": [BF16Linear(W) for W in weights]}
    make = Int8Linear.from_float if fmt == "int8" else (lambda W: Q4Linear(random_q4_blocks(*W.shape)))
    kernel = [make(W) for W in weights]
    for layer in kernel:
        layer.max_kernel_tokens = 1 << 30  # always the integer kernel
    columns = {fmt: kernel}
    if cpu_dot.available():
        columns[f"{fmt} dot"] = [make(W) for W in weights]
        for layer in columns[f"{fmt} dot"]:
            layer.max_kernel_tokens, layer.integer_dot = 1 << 30, True  # always cpu_dot.c's integer products
    dequant = [make(W) for W in weights]
    for layer in dequant:
        layer.max_kernel_tokens = -1  # always dequantize → the large-step GEMM
    return columns | {f"{fmt}→{'bf16' if LARGE_STEP_DTYPE == torch.bfloat16 else 'fp32'}": dequant}


def run_formats(args, config, flop_per_token_of) -> None:
    columns: dict[str, list] = {}
    weights = fused_weights(config)
    for fmt in args.formats:
        columns.update(format_layers(weights, fmt))
    del weights
    print(f"command: python -m nanoserve bench linear --formats {' '.join(args.formats)} "
          f"--tokens {' '.join(map(str, args.tokens))} --repeats {args.repeats}")
    print(f"threads: {torch.get_num_threads()}; ms per pass over all of the model's products (fused shapes), "
          f"best of {args.repeats}, columns interleaved")
    print(f"{'tokens':>7s} " + " ".join(f"{c:>11s}" for c in columns) + "   fastest")
    flop_per_token = flop_per_token_of(next(iter(columns.values())))
    for tokens in args.tokens:
        x = {n: torch.randn(tokens, n) for n in {layer.in_features for layer in next(iter(columns.values()))}}
        best = best_of({c: lambda layers=layers: layers_pass(layers, x) for c, layers in columns.items()}, args.repeats)
        fastest = min(best, key=best.get)
        print(f"{tokens:7d} " + " ".join(f"{best[c] * 1e3:11.1f}" for c in columns)
              + f"   {fastest} ({flop_per_token * tokens / best[fastest] / 1e9:.0f} GFLOP/s)")


def run_fused(args, config) -> None:
    from nanoserve.model.layers import linear

    print(f"command: python -m nanoserve bench linear --fused --tokens {' '.join(map(str, args.tokens))} "
          f"--repeats {args.repeats}")
    print(f"threads: {torch.get_num_threads()}; ms per pass over the model's products, separate q/k/v, gate/up "
          f"vs fused, best of {args.repeats}, interleaved")
    sets = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fused in (False, True):
            sets[(dtype, fused)] = [W.to(dtype) for W in fused_weights(config, fused)]
    print(f"{'tokens':>7s} {'fp32 sep':>9s} {'fp32 fused':>11s} {'bf16 sep':>9s} {'bf16 fused':>11s}")
    for tokens in args.tokens:
        inputs = {key: {n: torch.randn(tokens, n, dtype=key[0]) for n in {W.shape[1] for W in ws}}
                  for key, ws in sets.items()}
        best = best_of({key: lambda key=key: linear_pass(sets[key], inputs[key],
                                                         linear if key[0] == torch.float32 else F.linear)
                        for key in sets}, args.repeats)
        print(f"{tokens:7d} " + " ".join(f"{best[k] * 1e3:{w}.1f}" for k, w in zip(sets, (9, 11, 9, 11))))


@torch.inference_mode()
def run(args):
    from nanoserve.engine.worker import keep_freed_host_memory
    from nanoserve.model.config import LlamaConfig
    from nanoserve.model.layers import swap_ab

    keep_freed_host_memory()
    if args.formats:
        return run_formats(args, LlamaConfig(), lambda layers: 2 * sum(l.in_features * l.out_features for l in layers))
    if args.fused:
        return run_fused(args, LlamaConfig())
    weights = fused_weights(LlamaConfig())  # SmolLM2-135M's shapes, fused as the model runs them
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
        passes = {"plain": lambda: linear_pass(weights, inputs, F.linear),
                  "swapped": lambda: linear_pass(weights, inputs, swap_ab)}
        if bf16:
            passes["bf16"] = lambda: linear_pass(bf16, inputs16, F.linear)
        best = best_of(passes, args.repeats)
        plain, swapped, half = best["plain"], best["swapped"], best.get("bf16")
        flop = flop_per_token * tokens
        print(f"{tokens:7d} {plain * 1e3:10.1f} {swapped * 1e3:12.1f} {flop / plain / 1e9:14.1f} "
              f"{flop / swapped / 1e9:17.1f} {plain / swapped:8.2f}x"
              + (f" {half * 1e3:13.1f} {half / plain:10.2f}x" if bf16 else ""))
