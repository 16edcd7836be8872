"""`python -m nanoserve bench quality`: what quantized weights cost in quality, against float32 (chapter 10).

For each weight format, against the float32 model loaded from the same GGUF:

  greedy agreement   each chat prompt of CHAT_PROMPTS generates --max-tokens tokens greedily (through
                     the engine); agreement = share of the first N tokens identical to float32's, where a
                     sequence counts up to its first divergence (after it the two continue different texts)
  perplexity         exp(mean negative log-likelihood) of heldout.txt (written for this repo, not seen in
                     training), one forward pass
  logit difference   on the same pass: the largest |Δlogit| vs float32, and how often the top-1 token agrees

With q4 it also runs "q4+fp32head": the same q4 layers with float32's embedding and LM head, which shows
how much of the difference is the int8 LM head's (nanoserve/model/quant.py says why it is int8).

The held-out pass is one large step (the float32 GEMM or bf16 copy of chapter 10); the greedy tokens decode in the
small steps' kernel. A last table reads that kernel alone: each chat prompt's tokens in one pass of at most
QUANT_MAX_TOKENS tokens (the kernel's range in a bare model), largest |Δlogit| and top-1 agreement against
float32, once with torch's kernels and once with kernels/cpu_dot.c's integer products where it builds.
"""

import math
import os
from pathlib import Path

import torch
from torch.nn import functional as F

from nanoserve.cli.checks import positive_int, weight_format

HELDOUT = Path(__file__).with_name("heldout.txt")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a haiku about the sea.",
    "Explain what a prime number is to a child.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Suggest a name for a grey cat.",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "What is the difference between weather and climate?",
    "Summarise the story of Cinderella in two sentences.",
]


def register(sub):
    p = sub.add_parser("quality", help="greedy agreement, perplexity and logit error of int8 / q4 vs fp32 (chapter 10)")
    p.add_argument("--weights", nargs="+", default=["int8", "q4"], type=weight_format, help="formats to compare with fp32")
    p.add_argument("--max-tokens", type=int, default=32, help="N: greedy tokens per chat prompt")
    p.add_argument("--num-prompts", type=int, default=len(CHAT_PROMPTS))
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's, the cores); the figures' last digits can follow it")
    p.set_defaults(func=run)


def greedy_outputs(model, tokenizer, prompts: list[str], max_tokens: int, **llm_kwargs) -> list[list[int]]:
    """Greedy token ids per chat prompt, all prompts batched through the engine; EOS ignored (N tokens each).
    llm_kwargs: more of LLM's arguments (e.g. kv_cache_dtype="bf16")."""
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams

    llm = LLM(model, num_blocks=len(prompts) * (8 + max_tokens // 16), **llm_kwargs)  # a chat prompt fits in 8 blocks of 16
    chats = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where two generations differ (len(a) when they never do)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def heldout_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids))  # (T, vocab)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits[:-1].float(), ids[1:]).item())


def compare(models: dict, tokenizer, prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """{format: {agreement, first_divergence (mean), identical (prompts), ppl, max_dlogit, top1}}, fp32 first."""
    ids = torch.tensor(tokenizer.encode(HELDOUT.read_text()))
    ref_logits = heldout_logits(models["fp32"], ids)
    ref_gen = greedy_outputs(models["fp32"], tokenizer, prompts, max_tokens)
    rows = {}
    for name, model in models.items():
        logits = ref_logits if name == "fp32" else heldout_logits(model, ids)
        gen = ref_gen if name == "fp32" else greedy_outputs(model, tokenizer, prompts, max_tokens)
        div = [first_divergence(a, b) for a, b in zip(gen, ref_gen)]
        rows[name] = dict(agreement=sum(div) / (max_tokens * len(prompts)), first_divergence=sum(div) / len(div),
                          identical=sum(d == max_tokens for d in div), ppl=perplexity(logits, ids),
                          max_dlogit=(logits - ref_logits).abs().max().item(),
                          top1=(logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item())
    return rows


def run(args):
    from nanoserve.bench.offline import cpu_description
    from nanoserve.model import load_gguf
    from nanoserve.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    formats = list(dict.fromkeys(args.weights))  # checked by argparse (weight_format), each once
    formats = [w for w in formats if w != "fp32"]
    tokenizer = Tokenizer.from_gguf()
    models = {w: load_gguf(weights=w) for w in ["fp32", *formats]}
    if "q4" in formats:  # what the int8 LM head costs: the same q4 layers with float32's embedding and head
        models["q4+fp32head"] = load_gguf(weights="q4")
        models["q4+fp32head"].embed_tokens, models["q4+fp32head"].lm_head = models["fp32"].embed_tokens, models["fp32"].lm_head
    prompts = CHAT_PROMPTS[:args.num_prompts]
    rows = compare(models, tokenizer, prompts, args.max_tokens)
    n_ids = len(tokenizer.encode(HELDOUT.read_text()))
    print(f"command: python -m nanoserve bench quality --weights {' '.join(args.weights)} "
          f"--max-tokens {args.max_tokens} --num-prompts {args.num_prompts}"
          + (f" --threads {args.threads}" if args.threads else ""))
    # the bf16 GEMMs' order of additions follows the kernel oneDNN picks for the CPU: the figures too
    print(f"threads: {torch.get_num_threads()}; {cpu_description()}; load average at the start: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{len(prompts)} chat prompts x {args.max_tokens} greedy tokens; held-out text: {HELDOUT.name}, {n_ids} tokens")
    print(f"{'weights':12s} {'agreement':>10s} {'mean 1st div':>13s} {'identical':>10s} {'perplexity':>11s} "
          f"{'max |dlogit|':>13s} {'top-1 = fp32':>13s}")
    for name, r in rows.items():
        print(f"{name:12s} {r['agreement']:10.1%} {r['first_divergence']:13.1f} {r['identical']:5d}/{len(prompts):<4d} "
              f"{r['ppl']:11.3f} {r['max_dlogit']:13.3f} {r['top1']:13.1%}")
    small_step_table(models["fp32"], formats, tokenizer, prompts)


@torch.inference_mode()
def small_step_table(fp32, formats: list[str], tokenizer, prompts: list[str]) -> None:
    """Each quantized format's small-step kernels on the chat prompts' tokens, against float32 (module docstring)."""
    from nanoserve.kernels import cpu_dot
    from nanoserve.model import load_gguf
    from nanoserve.model.quant import QUANT_MAX_TOKENS, default_integer_dot

    kernels = {"torch's kernel": False} | ({"cpu_dot.c": True} if cpu_dot.available() else {})
    ids = [torch.tensor(tokenizer.encode_chat([{"role": "user", "content": p}])[:QUANT_MAX_TOKENS]) for p in prompts]
    refs = [heldout_logits(fp32, t) for t in ids]
    print(f"\nsmall steps: {len(prompts)} chat prompts, {sum(map(len, ids))} positions, each prompt one pass "
          f"(the default here: {'cpu_dot.c' if default_integer_dot() else 'torch' + chr(39) + 's kernel'})")
    print(f"{'weights':12s} {'kernel':>15s} {'max |dlogit|':>13s} {'top-1 = fp32':>13s}")
    for w in formats:
        if w not in ("int8", "q4"):
            continue
        for kernel, on in kernels.items():
            model = load_gguf(weights=w, integer_dot=on)
            got = [heldout_logits(model, t) for t in ids]
            worst = max((g - r).abs().max().item() for g, r in zip(got, refs))
            agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, refs))
            print(f"{w:12s} {kernel:>15s} {worst:13.3f} {agree:7d}/{sum(map(len, ids)):<5d}")
