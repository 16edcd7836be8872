"""`python -m nanoserve bench structured`: chapter 13's cost of structured outputs, measured side by side.

The chapter's schemas (nanoserve/structured/schemas.py) asked of the real SmolLM2, greedy, at 1 and at 16
concurrent requests, two systems after one warm-up round each, then interleaved round by round with the order
alternating (C U, U C, C U, ...: this machine drifts, and neither system always runs first):

  constrained     response_format json_schema: each request carries its grammar; every step fills the
                  constrained rows' masks and applies them
  unconstrained   the same prompts without a grammar, EOS ignored, each generating exactly as many tokens
                  as its constrained twin did in the warm-up (greedy: in every round): the same batch, step for step

Reported: TPOT p50 (chapter 09's definition, the engine's own clock) and output tokens/s; the compile time of
each schema cold (a fresh cache) and cached; the constrained TPOT's extra time split by measurement (the engine's
MaskTimes, per step of the best constrained round): advancing the matchers, filling the mask rows, applying the
masks to the logits, and the rest (the TPOT difference minus those three, not split further); the apply time of
a 16-row bitmask alone, ours (bitmask.py) beside xgrammar's C++ kernel (a micro-benchmark on random logits,
not the engine's MaskTimes.apply); and one choice-list mask, choice_mask's Python walk beside xgrammar's fill.
"""

import time

import torch

from nanoserve.metrics import percentile


def register(sub):
    p = sub.add_parser("structured", help="structured outputs: TPOT / throughput with and without a grammar (chapter 13)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per system (the best is kept)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def compile_times(tokenizer, vocab_size: int) -> dict[str, tuple[float, float]]:
    """schema -> (cold seconds, cached seconds): a fresh GrammarCache, then the same schema again."""
    from nanoserve.structured.compiler import GrammarCache
    from nanoserve.structured.params import StructuredOutputsParams
    from nanoserve.structured.schemas import SCHEMAS

    cache = GrammarCache(tokenizer, vocab_size)
    times = {}
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        cache.compile(params)
        t1 = time.perf_counter()
        cache.compile(StructuredOutputsParams(json=dict(schema)))  # another request, the same schema
        times[name] = (t1 - t0, time.perf_counter() - t1)
    return times


def apply_times(vocab_size: int, rows: int = 16, repeat: int = 20) -> tuple[float, float]:
    """Seconds to mask `rows` rows of logits: ours (bitmask.py), xgrammar's CPU kernel."""
    import xgrammar as xgr

    from nanoserve.structured.bitmask import apply_token_bitmask

    logits = torch.randn(rows, vocab_size)
    mask = torch.randint(-2**31, 2**31, (rows, (vocab_size + 31) // 32), dtype=torch.int64).to(torch.int32)
    index = list(range(rows))
    results = []
    for fn in (lambda: apply_token_bitmask(logits, mask, index),
               lambda: xgr.apply_token_bitmask_inplace(logits, mask, indices=index)):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        results.append((time.perf_counter() - t0) / repeat)
    return results[0], results[1]


def choice_mask_times(tokenizer, vocab_size: int, repeat: int = 3) -> tuple[float, float]:
    """Seconds for one next-token mask of the choice list ["red", "green", "blue"] at its root: our Python walk
    over the vocabulary (choice.choice_mask, what a choice list's compile does once per trie node), and xgrammar's
    fill_next_token_bitmask for the same choices as an EBNF grammar (what a step does per constrained row)."""
    import xgrammar as xgr

    from nanoserve.structured.choice import build_trie, choice_mask
    from nanoserve.structured.compiler import GrammarCache
    from nanoserve.structured.params import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    cache = GrammarCache(tokenizer, vocab_size)
    matcher = xgr.GrammarMatcher(cache.compile(StructuredOutputsParams(grammar='root ::= "red" | "green" | "blue"')))
    bitmask, trie = xgr.allocate_token_bitmask(1, vocab_size), build_trie(choices)
    results = []
    for fn in (lambda: choice_mask(trie, b"", cache.vocab, cache.stop_token_ids),
               lambda: matcher.fill_next_token_bitmask(bitmask)):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        results.append((time.perf_counter() - t0) / repeat)
    return results[0], results[1]


def run_round(engine, prompts, structured, lengths, concurrency: int, max_tokens: int) -> dict:
    """Every request to the end, `concurrency` at a time; {i: (tokens, tpot)}, and the wall time."""
    from nanoserve.sampling import SamplingParams

    out, t0, pending = {}, time.perf_counter(), list(range(len(prompts)))
    while pending or engine.has_unfinished_requests():
        while pending and engine.get_num_unfinished_requests() < concurrency:
            i = pending.pop(0)
            if structured is not None:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured[i])
            else:  # the constrained twin's length, exactly
                params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            if o.finished:
                out[int(o.request_id[1:])] = (len(o.token_ids), o.metrics["tpot"])
    return {"requests": out, "seconds": time.perf_counter() - t0}


def run(args):
    from nanoserve.bench.experiment import interleaved
    from nanoserve.llm import LLM
    from nanoserve.model import load_gguf
    from nanoserve.structured.params import StructuredOutputsParams
    from nanoserve.structured.schemas import SCHEMAS, prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(load_gguf(), num_blocks=512, max_num_seqs=16)
    engine, tokenizer = llm.engine, llm.tokenizer
    vocab = engine.vocab_size
    names = list(SCHEMAS)

    print("grammar compile time per schema (a fresh cache, then the same schema again):")
    for name, (cold, cached) in compile_times(tokenizer, vocab).items():
        print(f"  {name:8s} cold {cold * 1e3:7.2f} ms   cached {cached * 1e3:6.3f} ms")

    results = {}
    for concurrency in args.concurrency:
        n = len(names) if concurrency == 1 else concurrency
        picked = [names[i % len(names)] for i in range(n)]
        prompts = [tokenizer.encode_chat(prompt(name)) for name in picked]
        structured = [StructuredOutputsParams(json=SCHEMAS[name]) for name in picked]
        warm = run_round(engine, prompts, structured, None, concurrency, args.max_tokens)  # warm-up, not counted
        lengths = [warm["requests"][i][0] for i in range(n)]
        run_round(engine, prompts, None, lengths, concurrency, args.max_tokens)

        def measure(name, grammars, r):
            engine.structured.take_times()  # the warm-up's and the last round's are not this round's
            got = run_round(engine, prompts, grammars, lengths, concurrency, args.max_tokens)
            got["times"] = engine.structured.take_times()
            got["tpot_p50"] = percentile([tp for _, tp in got["requests"].values() if tp is not None], 50)
            got["tokens_per_s"] = sum(t for t, _ in got["requests"].values()) / got["seconds"]
            return got

        rounds = interleaved(args.rounds, {"constrained": structured, "unconstrained": None}, measure)
        results[concurrency] = {system: min(got, key=lambda g: g["tpot_p50"]) for system, got in rounds.items()}

    print(f"\ngreedy, max_tokens {args.max_tokens}, a warm-up round each, then the best of {args.rounds} interleaved "
          f"rounds (order alternating; shared machine: read the ratios):")
    print(f"  {'concurrency':>11s} {'system':>14s} {'TPOT p50':>10s} {'tokens/s':>9s}")
    for concurrency, best in results.items():
        for system in ("constrained", "unconstrained"):
            r = best[system]
            print(f"  {concurrency:>11d} {system:>14s} {r['tpot_p50'] * 1e3:7.1f} ms {r['tokens_per_s']:9.1f}")
        c, u = best["constrained"], best["unconstrained"]
        extra, t = c["tpot_p50"] - u["tpot_p50"], c["times"]
        parts = {name: getattr(t, name) / max(1, t.steps) for name in ("advance", "fill", "apply")}
        print(f"  {'':>11s} TPOT overhead at {concurrency}: {extra / u['tpot_p50'] * 100:+.1f} % = "
              f"{extra * 1e3:.2f} ms a step: matcher advance {parts['advance'] * 1e3:.2f} ms, mask fill "
              f"{parts['fill'] * 1e3:.2f} ms, mask apply {parts['apply'] * 1e3:.2f} ms, the rest "
              f"{(extra - sum(parts.values())) * 1e3:.2f} ms")
    ours, theirs = apply_times(vocab)
    print(f"\napplying a 16-row bitmask to (16, {vocab}) logits: ours (bitmask.py) {ours * 1e3:.2f} ms, "
          f"xgrammar's CPU kernel {theirs * 1e3:.2f} ms")
    walk, fill = choice_mask_times(tokenizer, vocab)
    print(f"one next-token mask of a choice list at its root: choice_mask's Python walk over {vocab} tokens "
          f"{walk * 1e3:.1f} ms (once per trie node, at compile), xgrammar's fill {fill * 1e3:.3f} ms")
    cmd = (f"python -m nanoserve bench structured --concurrency {' '.join(map(str, args.concurrency))} --rounds "
           f"{args.rounds} --max-tokens {args.max_tokens}" + (f" --threads {args.threads}" if args.threads else ""))
    print(f"\nreproduce: {cmd}")
