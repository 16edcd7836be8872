"""`python -m nanoserve bench peers`: nanoserve in each weight format against transformers' static batching
in float32 and bfloat16, on the same requests, in interleaved rounds.

The workload: distinct prompts of 20–200 tokens cut from real text (nanoserve/bench/heldout.txt), each
generating exactly --new-tokens tokens, greedy, EOS ignored. Per round every system serves all requests
once, in turn (nanoserve: all submitted at once, continuous batching; transformers: one static left-padded
batch of all of them, as bench offline's HF baseline), so a drift of the shared machine's speed hits every
system in every round; each system's figure is its median round. Then, per nanoserve format, batch-1 decode
tokens/s (--decode-tokens after a 32-token prompt: a short context) and the prefill rate of one --prefill-tokens
prompt.

With `--kv-cache-dtype auto bf16` each format also runs on a bf16 KV pool (the attention in bf16), and with
`--compile-mode eager buckets` each also through the compiled step (chapter 09, nanoserve/model/compiled.py), and
with `--integer-dot on off` each int8 / q4 format with kernels/cpu_dot.c's and with torch's small-step kernels
(chapter 10);
every system serves one untimed warm-up round first, which is where a compiled step compiles (its time printed);
the order of the systems is reversed every other round (`alternate`).
With `--llama-bench PATH`, the batch-1 figures are taken in --rounds interleaved rounds, each with one run of
llama.cpp's `llama-bench -m GGUF -t THREADS -n 128 -p 512` on the same GGUF, printed beside them.

Output tokens per second of wall time; the ratio column is against transformers bf16, the strongest peer.
"""

import itertools
import json
import os
import random
import statistics
import subprocess
import time

import torch

from nanoserve.cli.checks import AUTO_ON_OFF


def register(sub):
    p = sub.add_parser("peers", help="nanoserve's formats vs transformers static fp32/bf16, interleaved (chapters 09 and 10)")
    p.add_argument("--num-requests", type=int, nargs="+", default=[16, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "q4"], choices=["fp32", "bf16", "int8", "q4"])
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp32", "bf16"],
                   help="nanoserve's KV pool: each format runs once per dtype given (auto: float32)")
    p.add_argument("--compile-mode", nargs="+", default=["eager"], choices=["eager", "buckets", "dynamic"],
                   help="each format runs once per mode given: eager, or the compiled step (chapter 09)")
    p.add_argument("--integer-dot", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                   help="int8 / q4 small-step kernels: each quantized format runs once per choice given (chapter 10: "
                        "on = kernels/cpu_dot.c, off = torch's kernels)")
    p.add_argument("--native-decode", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                   help="q4's one-token steps: each q4 format runs once per choice given (chapter 09: on = "
                        "kernels/cpu_decode.c, the whole layer loop in one C call; off = the model's forward)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench: its tg128 and pp512 on the same GGUF beside the batch-1 figures")
    p.add_argument("--hf", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="transformers dtypes to compare with (none: skip them)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-tokens", type=int, default=2000)
    p.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode: tokens timed per format, after a 32-token prompt (not --prefill-tokens')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, = the cores); 1 on a machine busy with other jobs")
    p.set_defaults(func=run)


def text_requests(tokenizer, num_requests: int, lengths=(20, 200), seed: int = 0) -> list[list[int]]:
    """Distinct prompts: consecutive windows of heldout.txt's tokens, lengths drawn from `lengths`."""
    from nanoserve.bench.quality import HELDOUT

    ids, rng = tokenizer.encode(HELDOUT.read_text()), random.Random(seed)
    prompts, start = [], 0
    for _ in range(num_requests):
        n = rng.randint(*lengths)
        if start + n > len(ids):
            start = rng.randrange(0, 50)  # wrap round with another offset: still distinct windows
        prompts.append(ids[start:start + n])
        start += n
    return prompts


def nanoserve_job(llm, prompts, new_tokens):
    """A callable serving `prompts` once, returning its seconds. Every call salts the prompts' cache afresh:
    the warm-up, each round and the next --num-requests (whose prompts begin with the last one's) serve the
    same prompts, and a prefix-cache hit would time a prefill nanoserve skipped while transformers computes it."""
    from nanoserve.bench.offline import run_nanoserve

    calls = itertools.count()
    return lambda: run_nanoserve(llm.engine, [(p, new_tokens, {"cache_salt": f"call-{next(calls)}-{len(prompts)}"})
                                              for p in prompts])[0]


def hf_job(hf_model, prompts, new_tokens):
    from nanoserve.bench.offline import run_hf_static

    workload = [(p, new_tokens) for p in prompts]
    return lambda: run_hf_static(hf_model, workload, len(workload))


def single_stream(llm, prefill_tokens: int, decode_tokens: int, tokenizer) -> tuple[float, float]:
    """(batch-1 decode tok/s, prefill tok/s of one prefill_tokens prompt) through the engine."""
    from nanoserve.bench.offline import params

    engine = llm.engine
    prompt = (text_requests(tokenizer, 40, (200, 200))[0] * (prefill_tokens // 200 + 1))[:prefill_tokens]
    # a salt of its own each call: the prompt is the same every round, and a prefix-cache hit on the last
    # round's blocks would time a one-block prefill instead of prefill_tokens
    engine.add_request("prefill", prompt, params(1), cache_salt=f"prefill-{time.perf_counter_ns()}")
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    prefill = prefill_tokens / (time.perf_counter() - t0)
    engine.add_request("decode", prompt[:32], params(decode_tokens + 1))
    engine.step()  # the prefill and first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return decode_tokens / (time.perf_counter() - t0), prefill


def llama_bench(path: str, gguf, threads: int) -> tuple[float, float]:
    """(tg128, pp512) tokens/s from one run of llama.cpp's llama-bench on the GGUF."""
    out = subprocess.run([path, "-m", str(gguf), "-t", str(threads), "-n", "128", "-p", "512", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    rate = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return rate["tg"], rate["pp"]


def alternate(names: list[str], round_index: int) -> list[str]:
    """The systems' order in a round: as given in even rounds, reversed in odd ones, so no system always runs
    first (on a warm machine) or last (after the others' heat and cache traffic)."""
    return names if round_index % 2 == 0 else names[::-1]


def system_name(weights: str, kv: str, mode: str, dot: str = "auto", native: str = "auto") -> str:
    return (f"nanoserve {weights}" + ("" if kv == "auto" else f", kv {kv}") + ("" if mode == "eager" else f", {mode}")
            + {"auto": "", "on": ", cpu_dot", "off": ", torch kernels"}[dot]
            + {"auto": "", "on": ", native", "off": ", no native"}[native])


@torch.inference_mode()
def run(args):
    from nanoserve.cli.checks import UsageError
    from nanoserve.kernels import cpu_decode, cpu_dot
    from nanoserve.llm import LLM
    from nanoserve.model import embedded_gguf_path
    from nanoserve.text.tokenizer import Tokenizer

    if args.integer_dot != ["auto"] and not {"int8", "q4"} & set(args.formats):
        raise UsageError("--integer-dot chooses the small-step kernel of int8 / q4 weights: give --formats int8 or q4")
    if "on" in args.integer_dot and not cpu_dot.available():
        raise UsageError(f"--integer-dot on: kernels/cpu_dot.c does not build here ({cpu_dot.build_error()})")
    if args.native_decode != ["auto"] and "q4" not in args.formats:
        raise UsageError("--native-decode chooses how q4's one-token steps run: give --formats q4")
    if "on" in args.native_decode and "off" in args.integer_dot:
        raise UsageError("--native-decode on computes with cpu_dot.c's integer products: not with --integer-dot off "
                         "(give --native-decode auto, which turns it off there)")
    if "on" in args.native_decode and not cpu_decode.available():
        raise UsageError(f"--native-decode on: kernels/cpu_decode.c does not build here ({cpu_decode.build_error()})")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: python -m nanoserve bench peers --num-requests {' '.join(map(str, args.num_requests))} "
          f"--formats {' '.join(args.formats)} --kv-cache-dtype {' '.join(args.kv_cache_dtype)} "
          f"--compile-mode {' '.join(args.compile_mode)} --integer-dot {' '.join(args.integer_dot)} "
          f"--native-decode {' '.join(args.native_decode)} "
          f"--hf {' '.join(args.hf)} --rounds {args.rounds} --new-tokens {args.new_tokens} "
          f"--prefill-tokens {args.prefill_tokens} --decode-tokens {args.decode_tokens} --seed {args.seed}"
          + (f" --threads {args.threads}" if args.threads else "")
          + (f" --llama-bench {args.llama_bench}" if args.llama_bench else ""), flush=True)
    print(f"threads: {torch.get_num_threads()}; prompts 20-200 tokens of real text, {args.new_tokens} new tokens "
          f"each, greedy, EOS ignored; median of {args.rounds} interleaved rounds; load average "
          f"{os.getloadavg()[0]:.1f} at the start (this run's own threads not yet in it)")
    tokenizer = Tokenizer.from_gguf()
    # 24 blocks of 16 tokens per request (200 + 128 tokens at most), and room for the single stream's prompt
    blocks = max(max(args.num_requests) * 24, -(-(args.prefill_tokens + 1) // 16), -(-(32 + args.decode_tokens + 1) // 16))
    llms = {system_name(f, kv, mode, dot, native):
            LLM(weights=f, kv_cache_dtype=kv, num_blocks=blocks, max_num_seqs=max(args.num_requests),
                compile_mode=mode, integer_dot=AUTO_ON_OFF[dot], native_decode=AUTO_ON_OFF[native])
            for f in args.formats for kv in args.kv_cache_dtype for mode in args.compile_mode
            for dot in (args.integer_dot if f in ("int8", "q4") else ["auto"])
            for native in (args.native_decode if f == "q4" else ["auto"])}
    hf = {}
    if args.hf:
        from transformers import AutoModelForCausalLM

        path = embedded_gguf_path()
        base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        for dt in args.hf:
            hf[f"transformers {dt} static"] = base if dt == "fp32" else \
                AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    for n in args.num_requests:
        prompts = text_requests(tokenizer, n, seed=args.seed)
        jobs = {name: nanoserve_job(llm, prompts, args.new_tokens) for name, llm in llms.items()}
        jobs |= {name: hf_job(m, prompts, args.new_tokens) for name, m in hf.items()}
        times = {name: [] for name in jobs}
        for name, job in jobs.items():  # warm-up, untimed in the figures: a compiled step compiles its buckets here
            t0 = time.perf_counter()
            job()
            print(f"  warm-up {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        for r in range(args.rounds):
            for name in alternate(list(jobs), r):
                times[name].append(jobs[name]())
        rates = {name: n * args.new_tokens / statistics.median(ts) for name, ts in times.items()}
        base = rates.get("transformers bf16 static")
        print(f"\n{n} requests ({sum(map(len, prompts))} prompt tokens, {n * args.new_tokens} output tokens; load "
              f"average {os.getloadavg()[0]:.1f} as the rounds end, this run's threads in it):")
        for name, rate in rates.items():
            ratio = f"{rate / base:6.2f}x" if base else ""
            print(f"  {name:36s} {rate:8.1f} out tok/s  {ratio}   rounds: "
                  + " ".join(f"{t:.1f}s" for t in times[name]), flush=True)
    print(f"\nper system: batch-1 decode ({args.decode_tokens} tokens) and one {args.prefill_tokens}-token prefill, "
          f"median of {args.rounds} interleaved rounds")
    singles = {name: [] for name in llms} | ({"llama.cpp llama-bench": []} if args.llama_bench else {})
    for name, llm in llms.items():  # warm-up: the batch-1 and prefill shapes
        single_stream(llm, args.prefill_tokens, args.decode_tokens, tokenizer)
    for r in range(args.rounds):
        for name in alternate(list(singles), r):
            if name == "llama.cpp llama-bench":
                singles[name].append(llama_bench(args.llama_bench, embedded_gguf_path(), torch.get_num_threads()))
            else:
                singles[name].append(single_stream(llms[name], args.prefill_tokens, args.decode_tokens, tokenizer))
    for name, runs in singles.items():
        decode, prefill = (statistics.median(r[i] for r in runs) for i in (0, 1))
        what = "tg128" if name.startswith("llama.cpp") else "decode"
        size = "pp512" if name.startswith("llama.cpp") else "prefill"
        print(f"  {name:36s} {what} {decode:7.1f} tok/s   {size} {prefill:8.1f} tok/s   "
              f"{what} rounds: {' '.join(f'{r[0]:.1f}' for r in runs)}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end (this run's threads in it)")
