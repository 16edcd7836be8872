"""`python -m nanoserve bench spec`: chapter 14's speculative decoding, measured side by side in one run.

Part 1, batch 1: each prompt alone through engines without speculation and with each proposer at each k,
greedy (so every engine must produce the same tokens: the run checks it). The prompts are the course
set's "grounded" kind (rewrite / extract / repeat a given text: the answer copies its input) and its open
"chat" kind. Engines take turns prompt by prompt, so the machine's drift hits all of them alike.

Part 2, load: 1, 4, 16 grounded requests at once through the engine, without speculation and with n-gram
at --load-k (the batch-size policy switched off, to see where speculation itself stops paying).

Per engine: output tokens per second of wall time, its speedup over no speculation, the acceptance rate
(accepted / proposed tokens) and the mean accepted length (tokens a verifying step emits: accepted + 1).
"""

import time

import torch

from nanoserve.cli.checks import positive_int


def register(sub):
    p = sub.add_parser("spec", help="speculative decoding: tok/s and acceptance at batch 1 and under load (chapter 14)")
    p.add_argument("--prompts", type=positive_int, default=3, help="prompts of each kind (grounded, chat) at batch 1")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="greedy output tokens per request (at most)")
    p.add_argument("-k", type=positive_int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens to try")
    p.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    p.add_argument("--draft-layers", type=positive_int, default=None, help="the draft's layers (default: a quarter)")
    p.add_argument("--load", type=int, nargs="*", default=[1, 4, 16], help="concurrent requests in part 2 (none: skip)")
    p.add_argument("--load-k", type=positive_int, default=4, help="n-gram's k in part 2")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (bench/prompts.py course_prompts)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores; on a busy machine use 1, as bench weights --help says)")
    p.set_defaults(func=run)


def generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt at once, greedy; (outputs in order, wall seconds)."""
    from nanoserve.sampling import SamplingParams

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.token_ids
    return [outputs[i] for i in range(len(prompts))], time.perf_counter() - t0


class Measured:
    """One engine's totals over the run."""

    def __init__(self, engine):
        self.engine, self.tokens, self.seconds = engine, 0, 0.0

    def add(self, outputs, seconds):
        self.tokens += sum(map(len, outputs))
        self.seconds += seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def row(self, name: str, base: "Measured") -> str:
        s = self.engine.spec_stats
        acc = f"{s.acceptance_rate:10.2f} {s.mean_accepted_length:9.2f}" if s.num_drafts else f"{'-':>10} {'-':>9}"
        return f"  {name:<14} {self.tok_s:8.2f} {self.tok_s / base.tok_s:8.2f}x {acc}"


HEADER = f"  {'engine':<14} {'tok/s':>8} {'speedup':>9} {'acceptance':>10} {'mean len':>9}"


@torch.inference_mode()
def run(args):
    from nanoserve.bench.prompts import course_prompts
    from nanoserve.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.model import load_gguf
    from nanoserve.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_gguf(), Tokenizer.from_gguf()

    def engine(speculative=None, k=4):
        spec = (SpeculativeConfig(method=speculative, num_speculative_tokens=k, disable_by_batch_size=None,
                                  draft_num_layers=args.draft_layers) if speculative else None)
        config = EngineConfig(cache_config=CacheConfig(kv_cache_memory=256 << 20), speculative_config=spec)
        return LLMEngine(model, config, tokenizer)

    configs = {"off": engine()} | {f"{p} k={k}": engine(p, k) for p in args.proposers for k in args.k}
    draft = next((e.proposer for e in configs.values() if getattr(e.proposer, "num_layers", None)), None)
    print(f"batch 1, greedy, up to {args.max_tokens} tokens, {torch.get_num_threads()} thread(s)"
          + (f"; the draft: {draft.num_layers} of {model.config.num_hidden_layers} layers" if draft else ""))
    results = {}
    for kind in ("grounded", "chat"):
        prompts = [tokenizer.encode_chat(p["messages"]) for p in course_prompts(args.prompts, args.seed, [kind])]
        totals = {name: Measured(e) for name, e in configs.items()}
        for e in configs.values():
            e.spec_stats.__init__()
        for i, ids in enumerate(prompts):
            names = list(configs) if i % 2 == 0 else list(configs)[::-1]  # alternate who goes first
            outs = {}
            for name in names:
                outs[name], seconds = generate(configs[name], [ids], args.max_tokens)
                totals[name].add(outs[name], seconds)
            if any(o != outs["off"] for o in outs.values()):
                raise RuntimeError(f"{kind} prompt {i}: a speculative engine's greedy output differs from 'off'")
        print(f"\n{kind} prompts ({len(prompts)}), outputs identical with and without speculation:\n{HEADER}")
        for name, m in totals.items():
            print(m.row(name, totals["off"]))
        results[kind] = totals
    if args.load:
        load_engines = {"off": engine(), f"ngram k={args.load_k}": engine("ngram", args.load_k)}
        prompts = [tokenizer.encode_chat(p["messages"]) for p in course_prompts(max(args.load), args.seed + 1, ["grounded"])]
        print(f"\nload: N grounded requests at once, n-gram k={args.load_k} without the batch-size policy\n"
              f"  {'N':>3} {'off tok/s':>10} {'ngram tok/s':>12} {'speedup':>8} {'acceptance':>10}")
        for n in args.load:
            totals = {name: Measured(e) for name, e in load_engines.items()}
            for e in load_engines.values():
                e.spec_stats.__init__()
            for name in (list(load_engines) if n % 2 else list(load_engines)[::-1]):
                totals[name].add(*generate(load_engines[name], prompts[:n], args.max_tokens))
            off, spec = totals.values()
            print(f"  {n:>3} {off.tok_s:10.2f} {spec.tok_s:12.2f} {spec.tok_s / off.tok_s:7.2f}x "
                  f"{spec.engine.spec_stats.acceptance_rate:10.2f}")
    print("\nshared machine: compare the ratios of one run, not tok/s across runs. Reproduce:\n"
          f"  python -m nanoserve bench spec --prompts {args.prompts} --max-tokens {args.max_tokens} "
          f"-k {' '.join(map(str, args.k))} --proposers {' '.join(args.proposers)} "
          f"--load {' '.join(map(str, args.load))}" + (f" --threads {args.threads}" if args.threads else ""))
    return 0
