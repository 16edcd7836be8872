"""`python -m nanoserve bench profile`: where one engine step spends its time (chapter 09).

For each batch size B (default 1, 16, 64) the engine gets B fresh random prompts of --prompt-len tokens
and runs them under `torch.profiler`: step 1 prefills all B prompts at once (B · prompt-len tokens), the
next steps decode one token for each of the B sequences. Each step's time is split into the course's parts:

  linear            every Linear: q/k/v/o, gate/up/down, the LM head (chapter 02)
  attention         the attention of prefill chunks and decode groups (chapter 05), less its gathers
  K/V gather/store  writing new K/V into the pool and gathering blocks out of it (index ops)
  norms/RoPE/act    RMSNorm, RoPE, SiLU · up, residual adds, the embedding lookup
  native step       a q4 step of one token per sequence (up to 16 sequences on a CPU without native bf16, one
                    elsewhere) in kernels/cpu_decode.c (chapter 09): every layer and the final norm in one C call, its parts not split (its LM head counts as "linear")
  LoRA              the adapters' gathers, x·A·B for each row's adapter (chapter 19; with --lora-rank only)
  sampling          the next tokens: argmax for the default greedy requests; with --temperature > 0 (and
                    --top-p < 1) the softmax, the top-p sort and the draw of chapter 03's sampler
  scheduler/Python  schedule(), input preparation, the attention metadata, and the Python between the labelled
                    parts (the Python inside one, which dispatches its small ops, counts in that part: the
                    model's forward in norms/RoPE/act)

How: for the profile only, `labelled()` replaces each of those methods on its class with a wrapper that runs it
inside a `record_function` range, and puts the originals back when the profile ends: what the methods compute
does not change, only their timing is recorded. (A profiler's instrument, and deliberate: torch's forward hooks
could label the nn.Modules, but the scheduler's, the runner's and the KV pool's methods have no hook, so one
mechanism labels them all.) A part's time is its ranges' time minus the labelled ranges nested inside them;
whatever of the step no range claims is Python bookkeeping. The profiler adds a few microseconds per op, so the
step time without it is measured too and printed beside: each batch's steps run three times, first untimed (a
warm-up: lazy set-up and first allocations), then timed without the profiler, then under it.

The roofline: the same command measures this machine's read bandwidth (sum of a 256 MiB tensor) and its
float32 GEMM peak (a 2048³ matmul). A step must read every weight once (and the K/V it attends to), and do
2 FLOPs per weight per token: its time is at least max(bytes / bandwidth, FLOPs / peak), as far as the two
measured rates are the machine's best (on a shared machine they can fall short: a rough floor, then). The
larger term says which resource bounds the step; measured time far above both, with a large scheduler/Python share,
means overhead bounds it. With `--compile-mode buckets | dynamic` (chapter 09) the step runs compiled: its graphs
call no labelled method, so the compiled forward is labelled "norms/RoPE/act" as a whole, the attention (eager)
claims its own time inside it, and the product ops found inside it (PRODUCT_OPS) count as "linear": what stays
is the fused element-wise kernels. With `--weights bf16 | int8 | q4` (chapter 10) the parts are measured on that model,
but the roofline still counts float32 weights and the float32 GEMM peak: read it as float32's floor (the table
says so; a q4 step reads about a sixth of those bytes and can run below it). With q4 a decode step of up to 16 sequences runs
in kernels/cpu_decode.c by default ("native step"); `--native-decode off` profiles the model's forward there.
Every request samples with --temperature and --top-p (default 0 and 1: greedy, so the sampling part is one argmax
per sequence; chapter 03 measures the share of a real draw with them). With `--lora-rank R` (chapter 19) the engine
serves --max-loras random adapters of rank R on every projection (`max_lora_rank` R), the batch's requests spread
over them round robin; the roofline leaves the adapters out.
"""

import contextlib
import functools
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from nanoserve.cli.checks import AUTO_ON_OFF

PARTS = ["linear", "attention", "K/V gather/store", "norms/RoPE/act", "native step", "LoRA", "sampling",
         "scheduler/Python"]
GATHER_OPS = {"aten::index_select", "aten::index"}  # inside attention: reading blocks out of the pool
# inside a compiled step's graphs (no Python method runs there to label): the products, by their op
PRODUCT_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::_weight_int4pack_mm_for_cpu",
               "aten::_weight_int8pack_mm", "nanoserve::q4_1_matmul", "nanoserve::int8_matmul"}  # the last two: cpu_dot.c


def register(sub):
    from nanoserve.cli.checks import positive_int, weight_format

    p = sub.add_parser("profile", help="where a prefill and a decode step spend their time, plus the roofline (chapter 09)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps profiled per batch size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--weights", default="fp32", type=weight_format,
                   help="fp32, bf16, int8 or q4 (chapter 10; the quantized ones with the kernel crossover)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the KV pool's dtype (auto: float32)")
    p.add_argument("--compile-mode", default="eager", choices=["eager", "buckets", "dynamic"],
                   help="eager, or the compiled step (chapter 09)")
    p.add_argument("--native-decode", default="auto", choices=["auto", "on", "off"],
                   help="q4's one-token steps (chapter 09): auto / on = kernels/cpu_decode.c where it can run, "
                        "off = the model's forward (eager or compiled), the only way to profile that at batch 1")
    p.add_argument("--lora-rank", type=positive_int, default=None,
                   help="serve random LoRA adapters of this rank on every projection (chapter 19): their share")
    p.add_argument("--max-loras", type=positive_int, default=None,
                   help="with --lora-rank: adapters the batch mixes (default 4)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (0: greedy, the sampling part is an argmax; chapter 03)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: off; below 1 needs --temperature > 0)")
    p.add_argument("--out-dir", default="results/profile", help="profile.json and profile.png go here")
    p.set_defaults(func=run)


def labelled_methods():
    """(owner, method name, part) of everything the profile labels."""
    from nanoserve.engine.model_runner import ModelRunner
    from nanoserve.kernels.cpu_decode import NativeDecoder
    from nanoserve.engine.scheduler import Scheduler
    from nanoserve.kv.paged_attention import PagedAttention, PagedKVCache
    from nanoserve.model.block import DecoderBlock, LlamaAttention
    from nanoserve.model.layers import MLP, Linear, RMSNorm
    from nanoserve.model.compiled import CompiledModel
    from nanoserve.model.llama import Llama
    from nanoserve.lora.layers import LoRAMapping
    from nanoserve.model.quant import QuantLinear

    return [(Linear, "forward", "linear"), (QuantLinear, "forward", "linear"), (PagedAttention, "__call__", "attention"),
            (PagedKVCache, "store_kv", "K/V gather/store"),
            (RMSNorm, "forward", "norms/RoPE/act"), (MLP, "forward", "norms/RoPE/act"),
            (LlamaAttention, "forward", "norms/RoPE/act"), (DecoderBlock, "forward", "norms/RoPE/act"),
            (Llama, "forward", "norms/RoPE/act"), (CompiledModel, "forward", "norms/RoPE/act"),
            (NativeDecoder, "step", "native step"), (NativeDecoder, "logits", "linear"),
            (LoRAMapping, "apply", "LoRA"), (ModelRunner, "sample", "sampling"),
            (Scheduler, "schedule", "scheduler/Python"), (Scheduler, "update_from_output", "scheduler/Python"),
            (ModelRunner, "prepare_inputs", "scheduler/Python"), (PagedAttention, "__init__", "scheduler/Python")]


@contextlib.contextmanager
def labelled():
    """For the profile only: replace each labelled method on its class with a wrapper that runs it in a
    record_function range named 'ns|part|Owner.method'; the originals are put back on exit."""
    # An exception to the course's layering rule that no module replaces another's attributes from outside: a
    # profiler's instrument, confined to this context manager and undone on exit (forward hooks would reach the
    # nn.Modules, but the scheduler's, the runner's and the KV pool's methods have none; see the module docstring).
    originals = []
    for owner, name, part in labelled_methods():
        fn = owner.__dict__[name]

        def wrapper(*args, _fn=fn, _label=f"ns|{part}|{owner.__name__}.{name}", **kwargs):
            with torch.profiler.record_function(_label):
                return _fn(*args, **kwargs)

        originals.append((owner, name, fn))
        setattr(owner, name, functools.wraps(fn)(wrapper))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def part_of(event) -> str | None:
    return event.name.split("|")[1] if event.name.startswith("ns|") else None


def breakdown(events, step_label: str) -> list[dict[str, float]]:
    """Per profiled step (a range named step_label): {part: milliseconds}, the parts summing to the step."""
    steps = []
    for step in (e for e in events if e.name == step_label):
        own = {p: 0.0 for p in PARTS}

        def walk(event, owner):  # owner: the part of the nearest labelled range above `event`
            for child in event.cpu_children:
                part, ms = part_of(child), child.cpu_time_total / 1000
                if part is not None:
                    own[part] += ms
                    own[owner] -= ms  # the parent's time, less what its labelled children claim
                    walk(child, part)
                elif owner == "attention" and child.name in GATHER_OPS:
                    own["attention"] -= ms
                    own["K/V gather/store"] += ms
                elif owner == "norms/RoPE/act" and child.name in PRODUCT_OPS:  # a compiled graph's product
                    own[owner] -= ms
                    own["linear"] += ms
                else:
                    walk(child, owner)

        own["scheduler/Python"] = step.cpu_time_total / 1000  # the step's time nobody else claims
        walk(step, "scheduler/Python")
        steps.append(own)
    return steps


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` sums of an nbytes float32 tensor."""
    x = torch.ones(nbytes // 4)
    best = min(_timed(x.sum) for _ in range(repeats))
    return nbytes / best


def measure_gemm_peak(n: int = 2048, repeats: int = 3) -> float:
    """float32 matmul FLOP/s: the best of `repeats` (n, n) @ (n, n) products (2 n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_cost(config, num_tokens: int, num_sampled: int, contexts: list[int], new_per_seq: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one float32 step: every weight once, the K/V attended to; 2 FLOPs per weight per
    token, 2·2·H·D per (query, key) pair for attention. contexts: each sequence's keys after the step."""
    from nanoserve.memory import kv_bytes_per_token, layer_parameter_counts

    L, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    layer_weights = sum(layer_parameter_counts(config).values()) * L
    head = config.vocab_size * config.hidden_size
    weights_bytes = (layer_weights + head) * 4  # the (tied) LM head / embedding matrix read once
    kv_bytes = sum(contexts) * kv_bytes_per_token(config, "fp32")
    # a sequence's q queries see ctx - q + 1 .. ctx keys (causal): q · (ctx - (q - 1) / 2) pairs
    pairs = sum(new_per_seq * (c - (new_per_seq - 1) / 2) for c in contexts)
    flops = 2 * num_tokens * layer_weights + 2 * num_sampled * head + 4 * L * H * D * pairs
    return weights_bytes + kv_bytes, flops


def profile_batch(llm, batch: int, prompt_len: int, decode_steps: int, seed: int,
                  adapters: tuple[str | None, ...] = (None,), temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Profile one prefill step of `batch` prompts and `decode_steps` decode steps of `batch` sequences; request i
    under adapters[i % len(adapters)] (None: the base model, the default for every request), every request sampled
    with `temperature` and `top_p` (0 and 1: greedy)."""
    from nanoserve.sampling import SamplingParams

    engine, vocab = llm.engine, llm.model.config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=decode_steps + 3, ignore_eos=True)

    def add_batch(tag):
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params,
                               lora_name=adapters[i % len(adapters)])

    def steps(n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            with torch.profiler.record_function("ns-step"):
                engine.step()
            times.append(time.perf_counter() - t0)
        return times

    def finish():
        for seq_id in list(engine.scheduler.seqs):
            engine.abort_request(seq_id)

    add_batch("warm")  # every shape once, untimed: its first run pays for lazy set-up and first allocations
    steps(1 + decode_steps)
    finish()
    add_batch("timed")  # unprofiled: the honest step times
    prefill_s = steps(1)[0]
    decode_s = min(steps(decode_steps))
    finish()
    add_batch("prof")
    with labelled(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps(1 + decode_steps)
    finish()
    parts = breakdown(prof.events(), "ns-step")
    decode = {p: sum(s[p] for s in parts[1:]) / decode_steps for p in PARTS}
    config = llm.model.config
    return {
        "batch": batch,
        "prefill": {"tokens": batch * prompt_len, "step_ms": prefill_s * 1000, "parts_ms": parts[0],
                    "cost": step_cost(config, batch * prompt_len, batch, [prompt_len] * batch, prompt_len)},
        "decode": {"tokens": batch, "step_ms": decode_s * 1000, "parts_ms": decode,
                   "cost": step_cost(config, batch, batch, [prompt_len + 2] * batch, 1)},
    }


def bound(phase: dict, bandwidth: float, peak: float) -> dict:
    nbytes, flops = phase["cost"]
    memory_ms, compute_ms = nbytes / bandwidth * 1000, flops / peak * 1000
    overhead = phase["parts_ms"]["scheduler/Python"] / sum(phase["parts_ms"].values())
    verdict = "overhead" if overhead > 0.3 else ("memory" if memory_ms > compute_ms else "compute")
    return {"memory_ms": memory_ms, "compute_ms": compute_ms, "roofline_ms": max(memory_ms, compute_ms),
            "of_roofline": max(memory_ms, compute_ms) / phase["step_ms"], "overhead_share": overhead,
            "bound": verdict, "intensity_flop_per_byte": flops / nbytes}


def plot(results: list[dict], parts: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab10").colors
    for ax, phase in zip(axes, ["decode", "prefill"]):
        labels = [f"B={r['batch']}\n{r[phase]['tokens']} tok" for r in results]
        bottom = [0.0] * len(results)
        for color, part in zip(colors, parts):
            share = [100 * r[phase]["parts_ms"][part] / sum(r[phase]["parts_ms"].values()) for r in results]
            ax.bar(labels, share, bottom=bottom, label=part, color=color)
            bottom = [b + s for b, s in zip(bottom, share)]
        for i, r in enumerate(results):
            ax.text(i, 101, f"{r[phase]['step_ms']:.0f} ms", ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, 112)
        ax.set_title(f"one {phase} step: where the time goes")
        ax.set_ylabel("% of the profiled step")
    axes[1].legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    import sys

    from nanoserve.cli.checks import sampling_params
    from nanoserve.llm import LLM

    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.decode_steps < 1:
        print("error: --batch-sizes, --prompt-len and --decode-steps must be >= 1", file=sys.stderr)
        return 2
    if args.max_loras is not None and not args.lora_rank:
        print("error: --max-loras needs --lora-rank", file=sys.stderr)
        return 2
    args.max_loras = args.max_loras or 4
    sampling_params({"temperature": args.temperature, "top_p": args.top_p}, flags=True)  # a bad pair: one line
    if args.lora_rank and args.compile_mode != "eager":
        print("error: --lora-rank needs --compile-mode eager (LoRA runs on the eager engine)", file=sys.stderr)
        return 2
    if args.native_decode == "on":  # off is taken on any weights, as LLM and serve take it: the forward runs
        from nanoserve.kernels.cpu_decode import native_decode_blocker

        reason = native_decode_blocker(args.weights, None, 1, bool(args.lora_rank), args.kv_cache_dtype)
        if reason:
            print(f"error: --native-decode on: {reason}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    biggest = max(args.batch_sizes)
    llm = LLM(weights=args.weights, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=biggest, max_num_batched_tokens=biggest * args.prompt_len, enable_prefix_caching=False,
              num_blocks=biggest * (args.prompt_len // 16 + 2) + 8, compile_mode=args.compile_mode,
              native_decode=AUTO_ON_OFF[args.native_decode], enable_lora=bool(args.lora_rank), max_loras=args.max_loras, max_lora_rank=args.lora_rank or 16)
    adapters: tuple[str | None, ...] = (None,)
    with tempfile.TemporaryDirectory(prefix="nanoserve-profile-lora-") as tmp:
        if args.lora_rank:  # the directory lives as long as the run: an adapter memory drops is read again
            from nanoserve.bench.lora import write_random_adapter

            adapters = tuple(f"r{args.lora_rank}-{i}" for i in range(args.max_loras))
            for i, name in enumerate(adapters):
                llm.engine.add_lora(name, write_random_adapter(Path(tmp) / name, llm.model.config, args.lora_rank, i))
        bandwidth, peak = measure_bandwidth(), measure_gemm_peak()
        results = [profile_batch(llm, b, args.prompt_len, args.decode_steps, b, adapters, args.temperature, args.top_p)
                   for b in args.batch_sizes]
    bandwidth, peak = max(bandwidth, measure_bandwidth()), max(peak, measure_gemm_peak())  # before and after: the best
    print(f"command: python -m nanoserve bench profile --batch-sizes {' '.join(map(str, args.batch_sizes))} "
          f"--prompt-len {args.prompt_len} --decode-steps {args.decode_steps} --weights {args.weights} --kv-cache-dtype {args.kv_cache_dtype}"
          f" --compile-mode {args.compile_mode}" + (f" --native-decode {args.native_decode}" if args.weights == "q4" or args.native_decode != "auto" else "")
          + (f" --threads {args.threads}" if args.threads else "")
          + (f" --lora-rank {args.lora_rank} --max-loras {args.max_loras}" if args.lora_rank else "")
          + (f" --temperature {args.temperature} --top-p {args.top_p}" if args.temperature else ""))
    print(f"threads: {torch.get_num_threads()}, weights {args.weights}; this machine: read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"GEMM peak {peak / 1e9:.1f} GFLOP/s (ridge at {peak / bandwidth:.1f} FLOP/byte)")
    for r in results:
        for phase in ("decode", "prefill"):
            r[phase]["roofline"] = bound(r[phase], bandwidth, peak)
    # without adapters the LoRA part is 0, and without a native step (not q4, or no step of <= 16 one-token rows) its part
    native = any(r[phase]["parts_ms"]["native step"] for r in results for phase in ("decode", "prefill"))
    shown = [p for p in PARTS if (args.lora_rank or p != "LoRA") and (native or p != "native step")]
    header = f"{'step':>16s} {'ms':>8s} " + " ".join(f"{p[:12]:>12s}" for p in shown) + "   roofline ms (mem/compute)  bound"
    print(header)
    for phase in ("decode", "prefill"):
        for r in results:
            x, roof = r[phase], r[phase]["roofline"]
            total = sum(x["parts_ms"].values())
            print(f"{phase + ' B=' + str(r['batch']):>16s} {x['step_ms']:8.1f} "
                  + " ".join(f"{100 * x['parts_ms'][p] / total:11.0f}%" for p in shown)
                  + f"   {roof['memory_ms']:8.1f} / {roof['compute_ms']:8.1f}       {roof['bound']}")
    print("(parts: % of the profiled step; ms: the same step without the profiler)")
    if args.weights != "fp32":  # step_cost counts float32 bytes: a quantized step can run below this "floor"
        print(f"(roofline: float32 weights' bytes and GEMM peak, not {args.weights}'s: read it as float32's floor)")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "profile.json"), "w") as f:
        json.dump({"bandwidth_bytes_per_s": bandwidth, "gemm_flop_per_s": peak, "threads": torch.get_num_threads(),
                   "prompt_len": args.prompt_len, "temperature": args.temperature, "top_p": args.top_p,
                   "results": results}, f, indent=1)
    plot(results, shown, os.path.join(args.out_dir, "profile.png"))
    print(f"wrote {args.out_dir}/profile.json and profile.png")
