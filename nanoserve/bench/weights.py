"""`python -m nanoserve bench weights`: fp32 vs int8 vs q4 weights, side by side in one run (chapter 10).

  memory        bytes per weight and per decode step (scales and zeros included), bytes held
  products      every Linear of the model once over a batch of T tokens, cold from memory, best of
                --repeats after a warm-up round, the order alternating (bench linear's best_of): the float32 product vs each quantized layer's small-step product (torch's kernel
                with bf16 activations, or cpu_dot.c's integers where the layers take it: quant.py) vs
                dequantize-then-F.linear; at 1 token also torch's kernels with float32 activations.
                Where a `dequant` column overtakes its kernel is this CPU's crossover for a bare model; the
                bare model's QUANT_MAX_TOKENS (nanoserve/model/quant.py), 64, is chapter 06's old swap-AB bound,
                not derived from this table (on the course's AMX CPU int8's crossover lies below 64, q4's above).
  engine        batch-1 decode tok/s, batch-16 and batch-64 decode step time, prefill tok/s, and chapter 06's
                16-request workload (prompts 20–200, 128 output tokens each by default), one engine per format;
                int8 and q4 with LLM's crossover: their kernel up to KERNEL_CROSSOVER_TOKENS, a copy beyond
                (quant.LARGE_STEP_DTYPE). Every step goes through the model's forward: LLM(weights="q4") runs
                q4's decode steps of one-token rows in chapter 09's native decode step instead (up to
                cpu_decode.max_rows rows: 16 on a CPU without native bf16, 1 with it), which this bench does not
                turn on. So its q4 batch-1 row is q4 with --native-decode off, and where the native step takes
                16 rows so are its q4 batch-16 row and the 16-request workload's decode-only steps
                (`bench peers --native-decode auto off` measures both)

The engines run in lockstep — one step of fp32's engine, one of int8's, one of q4's, then the other way
round — each timed on its own clock, so the machine's drift (tens of per cent over minutes here) hits all
three alike; the product table's columns and the prefill's formats alternate their order the same way.
"""

import os
import sys
import time

import torch
from torch.nn import functional as F

from nanoserve.bench.linear import best_of

FORMATS = ["fp32", "int8", "q4"]


def register(sub):
    p = sub.add_parser("weights", help="speed and memory of fp32 / int8 / q4 weights, side by side (chapter 10)")
    # bf16 has no small-step kernel to time (`bench linear --formats` compares it): refused by argparse
    p.add_argument("--weights", nargs="+", default=FORMATS, choices=FORMATS,
                   help="formats to compare (default: all three)")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256],
                   help="batch sizes of the product table (none: skip it)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--workload-requests", type=int, default=16, help="chapter 06's workload; 0 skips it")
    p.add_argument("--workload-output-len", type=int, default=128, help="output tokens per workload request")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, = the cores); on a machine busy with other jobs use 1: "
                        "two threads on two shared cores wait on each other at every op (here up to 25x slower)")
    p.set_defaults(func=run)


# ---- products -----------------------------------------------------------------------------------------

def products(model) -> list:
    """The model's Linear layers (30 × qkv_proj, o_proj, gate_up_proj, down_proj, then the LM head: 121), as
    modules."""
    from nanoserve.model.layers import Linear
    from nanoserve.model.quant import QuantLinear

    return [m for m in model.modules() if isinstance(m, (Linear, QuantLinear))]


def time_pass(layers, inputs, call) -> float:
    t0 = time.perf_counter()
    for layer in layers:
        call(layer, inputs[layer.in_features])
    return time.perf_counter() - t0


def float32_kernel(layer, x):
    """The quantized kernel fed float32 activations (its scales then must be float32 too)."""
    if hasattr(layer, "qweight"):
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scale.float())
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scale_and_zero.float())


def integer_dot(models: dict) -> bool:
    """Whether the quantized models' layers take cpu_dot.c's products (quant.default_integer_dot at load)."""
    from nanoserve.model.quant import QuantLinear

    return any(getattr(m, "integer_dot", False) for model in models.values() for m in model.modules()
               if isinstance(m, QuantLinear))


def product_table(models: dict, tokens: list[int], repeats: int):
    from nanoserve.model.quant import LARGE_STEP_DTYPE

    layers = {name: products(m) for name, m in models.items()}
    calls = {"fp32": ("fp32", lambda layer, x: layer(x))}
    for name in models:
        if name != "fp32":
            calls[f"{name} kernel"] = (name, lambda layer, x: layer.kernel(x))
            calls[f"{name} dequant"] = (name, lambda layer, x: F.linear(x.to(LARGE_STEP_DTYPE),
                                                                         layer.dequantize().to(LARGE_STEP_DTYPE)))
    dtype = str(LARGE_STEP_DTYPE).removeprefix("torch.")
    print(f"\nproducts: all {len(next(iter(layers.values())))} Linear layers "
          f"once, ms (best of {repeats} after a warm-up, the order alternating); kernel = the layer's small-step product ("
          f"{'cpu_dot.c, activations in int8 blocks' if integer_dot(models) else 'torch kernel, bf16 activations'}); "
          f"dequant = the weight dequantized to {dtype} + {dtype} F.linear (a large step without a kept copy: "
          f"quant.LARGE_STEP_DTYPE on this CPU)")
    print(f"{'tokens':>7s}" + "".join(f"{c:>15s}" for c in calls))
    widths = {layer.in_features for layer in next(iter(layers.values()))}  # hidden and intermediate size
    for T in tokens:
        inputs = {n: torch.randn(T, n) for n in widths}
        best = best_of({c: lambda name=name, call=call: time_pass(layers[name], inputs, call)
                        for c, (name, call) in calls.items()}, repeats)
        print(f"{T:7d}" + "".join(f"{best[c] * 1e3:15.1f}" for c in calls))
    quantized = [n for n in models if n != "fp32"]
    if quantized:
        inputs = {n: torch.randn(1, n) for n in widths}
        ms = {n: min(time_pass(layers[n], inputs, float32_kernel) for _ in range(2)) * 1e3 for n in quantized}
        print("  1 token, torch's kernels with float32 activations (and scales): "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()))


# ---- engine measurements, in lockstep ---------------------------------------------------------------

def lockstep(engines: dict, requests: list, decode_only: bool = False, outputs: dict | None = None) -> dict[str, list[float]]:
    """Submit `requests` [(prompt ids, max_tokens)] to every engine, then step them in turn until all are idle (the
    turn's order reversed every other round: no engine always steps first).
    Returns each engine's step times (seconds); with decode_only, only steps in which every token was a decode.
    outputs: a dict that gets, per engine, [(its clock after the step: the sum of its step times, the step's
    RequestOutputs)] — what `bench degrade` computes TTFT and agreement from."""
    from nanoserve.bench.offline import params

    for engine in engines.values():
        for i, (prompt, n) in enumerate(requests):
            engine.add_request(str(i), prompt, params(n))
    times = {name: [] for name in engines}
    clocks = dict.fromkeys(engines, 0.0)
    names, turn = list(engines), 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        turn += 1
        for name in (names if turn % 2 else names[::-1]):
            engine = engines[name]
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            step_outputs = engine.step()
            dt = time.perf_counter() - t0
            clocks[name] += dt
            if outputs is not None:
                outputs.setdefault(name, []).append((clocks[name], step_outputs))
            out = engine.last_scheduler_output
            if not decode_only or out.total_num_scheduled_tokens == len(out.scheduled_seqs):
                times[name].append(dt)
    return times


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def run(args):
    import random

    from nanoserve.bench.model import timed
    from nanoserve.bench.offline import make_workload
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.worker import keep_freed_host_memory
    from nanoserve.memory import parameter_counts
    from nanoserve.model import load_gguf
    from nanoserve.model.quant import decode_bytes, resident_bytes

    formats = list(dict.fromkeys(args.weights))  # checked by argparse (choices), each once
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_host_memory()
    start = time.perf_counter()

    def progress(what):  # a long run shows where it is (on stderr: stdout stays the table)
        print(f"  [{time.perf_counter() - start:6.0f} s] {what}", file=sys.stderr, flush=True)

    models = {w: load_gguf(weights=w) for w in formats}
    config = next(iter(models.values())).config
    print("command: python -m nanoserve bench weights " + " ".join(
        [f"--weights {' '.join(formats)}", f"--tokens {' '.join(map(str, args.tokens))}".rstrip(), f"--repeats {args.repeats}",
         f"--decode-batches {' '.join(map(str, args.decode_batches))}", f"--decode-steps {args.decode_steps}",
         f"--prefill-len {args.prefill_len}",
         f"--workload-requests {args.workload_requests}", f"--workload-output-len {args.workload_output_len}"]
        + ([f"--threads {args.threads}"] if args.threads else [])))
    print(f"threads: {torch.get_num_threads()}; load average at the start: {os.getloadavg()[0]:.2f}")
    n_weights = parameter_counts(config)["total"]
    print(f"\nmemory ({n_weights:,} weights; a decode step reads every product's weights once, not the embedding)")
    print(f"{'weights':8s} {'read per decode step':>21s} {'bytes/weight':>13s} {'held in memory':>15s}")
    per_step = {}
    for name, model in models.items():
        per_step[name] = decode_bytes(model)
        print(f"{name:8s} {per_step[name] / 1e6:17.1f} MB {per_step[name] / n_weights:13.3f} "
              f"{resident_bytes(model) / 1e6:12.1f} MB")

    progress("models loaded")
    if args.tokens:
        product_table(models, args.tokens, args.repeats)
        progress("product table done")

    from nanoserve.model.quant import set_kernel_crossover

    for name, model in models.items():  # LLM's crossover: the kernel up to it, a copy beyond
        if name in ("int8", "q4"):
            set_kernel_crossover(model)
    with torch.inference_mode():
        engine_config = EngineConfig(cache_config=CacheConfig(kv_cache_memory=384 << 20))
        engines = {n: LLMEngine(m, engine_config) for n, m in models.items()}
        lockstep(engines, make_workload(4, (8, 16), (2, 4), 1, config.vocab_size))  # warm up
        rng = random.Random(0)
        print(f"\nengine (one engine per format, stepped in lockstep; median decode step of {args.decode_steps})")
        decode = {}
        for batch in args.decode_batches:
            requests = [([rng.randrange(config.vocab_size) for _ in range(16)], args.decode_steps + 1)
                        for _ in range(batch)]
            decode[batch] = {n: median(t) for n, t in lockstep(engines, requests, decode_only=True).items()}
            progress(f"batch-{batch} decode done")
        prompt = torch.randint(0, config.vocab_size, (args.prefill_len,), generator=torch.Generator().manual_seed(0))
        # the model's own forward over the prompt (no engine step), the formats taking turns as in the products
        prefill = best_of({n: lambda m=m: timed(lambda: m.compute_logits(m(prompt)[-1:]), 1)
                           for n, m in models.items()}, args.repeats)
        progress("prefill done")
        workload = None
        if args.workload_requests:
            out_len = args.workload_output_len
            workload = make_workload(args.workload_requests, (20, 200), (out_len, out_len), 0, config.vocab_size)
            wall = {n: sum(t) for n, t in lockstep(engines, workload).items()}
            out_tokens = sum(n for _, n in workload)
            progress("workload done")

    base = "fp32" if "fp32" in models else formats[0]
    rows = []
    for batch, times in decode.items():
        rows.append((f"batch-{batch} decode step, ms", {n: times[n] * 1e3 for n in models}, False))
        rows.append((f"batch-{batch} decode, tok/s", {n: batch / times[n] for n in models}, True))
    if 1 in decode:
        # the weights over a whole engine step (attention, norms, casts included), not the products' own rate
        rows.append(("batch-1 decode, weight MB / step s", {n: per_step[n] / decode[1][n] / 1e6 for n in models}, True))
    rows += [(f"prefill {args.prefill_len} (forward), tok/s", {n: args.prefill_len / prefill[n] for n in models}, True)]
    if workload:
        rows.append((f"{len(workload)}-request workload, out tok/s", {n: out_tokens / wall[n] for n in models}, True))
    print(f"{'':34s}" + "".join(f"{n:>10s}" for n in models) + "".join(f"{n + '/' + base:>12s}" for n in models if n != base))
    for label, values, higher_is_better in rows:
        ratios = [values[n] / values[base] if higher_is_better else values[base] / values[n] for n in models if n != base]
        print(f"{label:34s}" + "".join(f"{values[n]:10.1f}" for n in models) + "".join(f"{r:11.2f}x" for r in ratios))
    print(f"(ratios: how many times faster than {base}; the {len(workload) if workload else 0}-request workload: "
          f"prompts 20-200, {args.workload_output_len} output tokens each, EOS ignored, seed 0)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}, {time.perf_counter() - start:.0f} s in all "
          f"(others' work on the machine slows every format alike; the ratios are the figures)")
