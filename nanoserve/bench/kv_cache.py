"""`python -m nanoserve bench kv-cache`: what the naive KV cache of chapter 04 buys, and what it wastes.

  1. decode tokens/s with and without the cache as the context grows, side by side in one run:
     without a cache step t is a forward pass over all C + t tokens; with it, over one token that
     attends to C + t cached keys. Both go through generate's `next_token_logits`, the one seam
     where the two paths differ. Both paths are warmed up once first; then each context runs --rounds
     rounds, and the path that goes first alternates from round to round and from context to context
     (so even --rounds 1 gives neither path the first place everywhere: this machine drifts, and the
     first run after a switch may pay for cold caches); each path keeps its best round, and the table
     shows the worst beside it. In the cache's rounds chapter 01's attention is timed on its own, when
     it serves a decode step's one query (never the prefill's, even of a 1-token prompt): the column "attention" is its time per step, over all
     layers (repeat_kv's copy of the cached K/V included), and its share of the whole step.
  2. the share of a max-length reservation that a realistic mix of requests never uses.
     The mix (seeded): prompt and output lengths are log-normal, medians 256 and 128 tokens,
     sigma 1 (most requests are short, a few are long), clipped so prompt + output <= max_len.
     Each request reserves max_len tokens of cache; waste = 1 - used / reserved.
"""

import math
import os
import time

import torch

from nanoserve.cli.checks import UsageError, context_length, positive_int
from nanoserve.generate import next_token_logits
from nanoserve.kv.naive import NaiveKVCache
from nanoserve.memory import format_bytes, kv_bytes_per_token
from nanoserve.model.attention import scaled_dot_product_attention


def register(sub):
    p = sub.add_parser("kv-cache", help="decode tokens/s with vs without the KV cache; waste of max-length reservation")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[64, 256, 512, 1024],
                   help="prompt lengths before the timed decode steps")
    p.add_argument("--cache-tokens", type=positive_int, default=32, help="decode steps timed with the cache")
    p.add_argument("--no-cache-tokens", type=positive_int, default=4,
                   help="decode steps timed without it (slow at long contexts)")
    p.add_argument("--max-len", type=positive_int, default=2048,
                   help="tokens reserved per request, at least 2 (one prompt and one output token)")
    p.add_argument("--requests", type=positive_int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds per context, the two paths alternating which goes first")
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                   help="torch CPU threads; chapter 04's table used 1, which needs only one free core on a shared machine")
    p.set_defaults(func=run)


def decode_tokens_per_second(model, context: int, num_tokens: int, use_cache: bool, attention=None) -> float:
    """Tokens/s of `num_tokens` greedy decode steps after a random `context`-token prompt (not timed).
    `attention`: the cache's attention function (default: chapter 01's)."""
    token_ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = NaiveKVCache(model.config, context + num_tokens, attention=attention or scaled_dot_product_attention) \
        if use_cache else None
    token_ids.append(int(next_token_logits(model, token_ids, cache).argmax()))  # prefill
    start = time.perf_counter()
    for _ in range(num_tokens):
        token_ids.append(int(next_token_logits(model, token_ids, cache).argmax()))
    return num_tokens / (time.perf_counter() - start)


class DecodeAttentionTimer:
    """Chapter 01's attention, with the seconds it spends on the passes after the prefill (the decode steps) added up."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, q, k, v, causal=True):
        start = time.perf_counter()
        out = scaled_dot_product_attention(q, k, v, causal)
        # q (1, H, T, D), k (1, Hkv, S, D): the prefill's queries are all its keys (S = T, even for a 1-token
        # prompt); a pass after it also attends the cached keys (S > T). Only those are timed.
        if k.shape[2] > q.shape[2]:
            self.seconds += time.perf_counter() - start
        return out


def path_order(context_index: int, round_index: int) -> tuple[bool, bool]:
    """Which path runs first (use_cache False or True): it alternates by round and by context."""
    return (False, True) if (context_index + round_index) % 2 == 0 else (True, False)


def warm_up(model, context: int) -> None:
    """One short untimed run of each path, so that neither meets the process cold in the first timed round."""
    for use_cache in (False, True):
        decode_tokens_per_second(model, context, 2, use_cache)


def compare_paths(model, context: int, context_index: int, rounds: int, cache_tokens: int,
                  no_cache_tokens: int) -> tuple[dict[bool, list[float]], list[float]]:
    """`rounds` rounds of both paths at one context in path_order: tok/s per path ({False: [...], True: [...]}),
    and the cache's attention in seconds per decode step, one per round of the cache."""
    rates, attention = {False: [], True: []}, []
    for r in range(rounds):
        for use_cache in path_order(context_index, r):
            timer = DecodeAttentionTimer() if use_cache else None
            tokens = cache_tokens if use_cache else no_cache_tokens
            rates[use_cache].append(decode_tokens_per_second(model, context, tokens, use_cache, timer))
            if use_cache:
                attention.append(timer.seconds / tokens)
    return rates, attention


def request_lengths(num_requests: int, max_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and output lengths of a seeded request mix (see the module docstring). Two (num_requests,) tensors."""
    g = torch.Generator().manual_seed(seed)

    def log_normal(median: float) -> torch.Tensor:
        return torch.empty(num_requests).log_normal_(math.log(median), 1.0, generator=g).round().long()

    prompt = log_normal(256).clamp(1, max_len - 1)
    output = torch.minimum(log_normal(128).clamp(min=1), max_len - prompt)
    return prompt, output


def reservation_waste(used: torch.Tensor, max_len: int) -> float:
    """The share of `max_len`-per-request reservations that `used` tokens leave empty."""
    return 1 - used.sum().item() / (len(used) * max_len)


def check_args(args) -> None:
    """What the counts' types cannot see, refused before the model loads."""
    if args.max_len < 2:
        raise UsageError(f"--max-len must be at least 2 (a request is one prompt and one output token), got {args.max_len}")
    longest = max(args.contexts) + max(args.cache_tokens, args.no_cache_tokens)
    context = context_length(None)
    if longest > context:
        raise UsageError(f"--contexts {max(args.contexts)} with {max(args.cache_tokens, args.no_cache_tokens)} decode "
                         f"steps is {longest} tokens, more than the model's context of {context}")


@torch.inference_mode()
def run(args):
    from nanoserve.model import load_gguf

    check_args(args)
    torch.set_num_threads(args.threads)
    model = load_gguf()
    print(f"command: python -m nanoserve bench kv-cache --contexts {' '.join(map(str, args.contexts))} "
          f"--cache-tokens {args.cache_tokens} --no-cache-tokens {args.no_cache_tokens} "
          f"--max-len {args.max_len} --requests {args.requests} --seed {args.seed} --threads {args.threads} "
          f"--rounds {args.rounds}")
    print(f"threads: {args.threads}, load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"best of {args.rounds} rounds per path (worst in brackets), the paths alternating which goes first "
          f"by round and by context, after one warm-up run of each; attention: per decode step of the cache's best "
          f"round, all layers, and its share of the step\n")
    print(f"{'context':>8s} {'no cache tok/s':>22s} {'cache tok/s':>20s} {'speed-up':>9s} {'attention ms/step':>22s}")
    warm_up(model, min(args.contexts))
    for i, context in enumerate(args.contexts):
        rates, attention = compare_paths(model, context, i, args.rounds, args.cache_tokens, args.no_cache_tokens)
        without, with_cache = max(rates[False]), max(rates[True])
        best = rates[True].index(with_cache)
        share = attention[best] * with_cache  # seconds of attention per step / seconds per step
        print(f"{context:8d} {without:13.2f} ({min(rates[False]):5.2f}) {with_cache:12.1f} ({min(rates[True]):5.1f}) "
              f"{with_cache / without:8.1f}× {attention[best] * 1e3:14.1f} ({share:4.0%})")

    prompt, output = request_lengths(args.requests, args.max_len, args.seed)
    used = prompt + output
    waste = reservation_waste(used, args.max_len)
    per_token = kv_bytes_per_token(model.config, "fp32")
    print(f"\nreservation: {args.requests} requests, each reserving max_len {args.max_len} tokens "
          f"(prompt ~ lognormal median 256, output ~ lognormal median 128, sigma 1, seed {args.seed})")
    print(f"  tokens used: mean {used.float().mean():.0f}, median {used.median():.0f}, max {used.max()}")
    print(f"  KV reserved {format_bytes(len(used) * args.max_len * per_token)}, "
          f"used {format_bytes(used.sum().item() * per_token)} (SmolLM2, fp32)")
    print(f"  waste = 1 - used / reserved = {waste:.1%}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
