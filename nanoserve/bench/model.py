"""`python -m nanoserve bench model`: chapter 02's baseline numbers, before any cache.

  - load time of the GGUF (dequantize to float32, build the model)
  - prefill tokens/s: one forward pass over a P-token prompt
  - decode tokens/s *without a cache*: every new token recomputes the whole sequence,
    so step t costs a forward pass over P + t tokens. Chapters 04–06 improve on this.
  - with --with-cache (chapter 03's "positions are not time"): the same greedy reply of --decode-tokens
    tokens after the prompt, by chapter 03's generate loop without and with chapter 04's KV cache, each
    warmed up once, then --rounds rounds interleaved (the order alternating: chapter 09's harness); the
    speed-up is the median of the rounds' ratios, beside the ratio of token positions computed.
"""

import os
import statistics
import time

import torch

from nanoserve.cli.checks import positive_int


def register(sub):
    p = sub.add_parser("model", help="load time, prefill tokens/s and no-cache decode tokens/s (chapter 02)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--with-cache", action="store_true",
                   help="also time the same reply with and without chapter 04's KV cache, interleaved (chapter 03)")
    p.add_argument("--rounds", type=positive_int, default=3, help="with --with-cache: interleaved rounds")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=run)


def timed(fn, repeats: int) -> float:
    """Best of `repeats` wall times: the least disturbed run on a noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def reply_seconds(model, prompt: list[int], num_tokens: int, use_cache: bool) -> tuple[float, list[int]]:
    """(seconds, token ids) of one greedy reply of `num_tokens` tokens after `prompt`, by chapter 03's generate
    loop: without a cache each step runs the whole sequence; with chapter 04's a prefill, then 1-token steps."""
    from nanoserve.generate import generate
    from nanoserve.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = generate(model, prompt, params, eos_token_id=-1, use_cache=use_cache)
    return time.perf_counter() - t0, out.token_ids


def cache_or_not(model, prompt: list[int], num_tokens: int, rounds: int) -> None:
    """Print the same reply's time without and with the KV cache: warmed up, `rounds` interleaved rounds."""
    from nanoserve.bench.experiment import interleaved

    paths = {"no cache": False, "cache": True}
    for use_cache in paths.values():  # warm-up: the first call of each path pays for cold caches and allocations
        reply_seconds(model, prompt, 2, use_cache)
    load = os.getloadavg()[0]
    runs = interleaved(rounds, paths, lambda name, use_cache, r: reply_seconds(model, prompt, num_tokens, use_cache))
    replies = {tuple(ids) for results in runs.values() for _, ids in results}
    seconds = {name: [t for t, _ in results] for name, results in runs.items()}
    ratios = [a / b for a, b in zip(seconds["no cache"], seconds["cache"])]
    P, n = len(prompt), num_tokens
    work, cached = n * P + n * (n - 1) // 2, P + n - 1
    print(f"\nthe same reply without and with chapter 04's KV cache: {n} greedy tokens after a {P}-token prompt, "
          f"chapter 03's generate loop")
    print(f"warmed up, then {rounds} rounds interleaved (the order alternating); identical replies: {len(replies) == 1}")
    for r in range(rounds):
        print(f"  round {r + 1}: no cache {seconds['no cache'][r]:6.2f} s, cache {seconds['cache'][r]:6.2f} s "
              f"({ratios[r]:.1f}×)")
    median = {name: statistics.median(ts) for name, ts in seconds.items()}
    print(f"median: no cache {median['no cache']:.2f} s, cache {median['cache']:.2f} s; speed-up (median of the "
          f"rounds) {statistics.median(ratios):.1f}× (rounds {min(ratios):.1f}–{max(ratios):.1f}×)")
    print(f"token positions computed: {work:,} without the cache, {cached} with it ({work / cached:.1f}× fewer)")
    print(f"mean forward pass ({n} either way): no cache {median['no cache'] / n * 1000:.0f} ms (over {P} to {P + n - 1} "
          f"tokens each), cache {median['cache'] / n * 1000:.0f} ms (one {P}-token prefill, then {n - 1} passes of 1 token)")
    print(f"load average {load:.1f} before the rounds, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")


@torch.inference_mode()
def run(args):
    from nanoserve.model import load_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = load_gguf()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0))

    prefill_s = timed(lambda: model.compute_logits(model(prompt)[-1:]), args.repeats)

    def decode_without_cache():
        ids = prompt
        for _ in range(args.decode_tokens):
            next_id = model.compute_logits(model(ids)[-1:]).argmax(-1)  # the whole sequence, again
            ids = torch.cat([ids, next_id])

    decode_s = timed(decode_without_cache, 1)
    extra = (f" --with-cache --rounds {args.rounds}" if args.with_cache else "") + \
        (f" --threads {args.threads}" if args.threads else "")
    print(f"command: python -m nanoserve bench model --prompt-len {args.prompt_len} --decode-tokens {args.decode_tokens}"
          + extra)
    print(f"threads: {torch.get_num_threads()}")
    print(f"load time:            {load_s:8.2f} s")
    print(f"prefill ({args.prompt_len} tokens):  {args.prompt_len / prefill_s:8.1f} tokens/s  ({prefill_s * 1000:.0f} ms)")
    print(f"decode, no cache:     {args.decode_tokens / decode_s:8.1f} tokens/s  "
          f"({args.decode_tokens} tokens after a {args.prompt_len}-token prompt)")
    if args.with_cache:
        cache_or_not(model, prompt.tolist(), args.decode_tokens, args.rounds)
