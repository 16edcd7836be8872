"""Chapter 18 — load or recompute: which is cheaper for n cached tokens found in the second tier?

    recompute(n) = n · prefill_s_per_token                         (their share of a prefill step)
    load(n)      = load_latency_s + n · bytes_per_token / tier_bytes_per_s

Load when load(n) < recompute(n). Both grow with n; loading pays a fixed latency first (waking the reader,
page faults, a network round trip for a remote store), so short prefixes are recomputed and long ones loaded
once the tier's bandwidth beats the prefill's rate:

    crossover n* = load_latency_s / (prefill_s_per_token − bytes_per_token / tier_bytes_per_s)

and when bytes_per_token / tier_bytes_per_s ≥ prefill_s_per_token (a slow tier, or a fast GPU) loading never
pays. Worked example, SmolLM2 float32 (46,080 B per token), prefill 0.5 ms per token, 1 ms latency:
a 1 GB/s tier loads a token in 0.046 ms, n* = 1 / (0.5 − 0.046) ≈ 2.2 tokens — load anything longer than
2 tokens; a 50 MB/s tier (0.92 ms per token) never beats recompute.

The rates are measured while serving (rates.py: MeasuredRates), and the engine decides with the latest.
"""


def should_load(num_tokens: int, bytes_per_token: float, prefill_s_per_token: float | None,
                tier_bytes_per_s: float | None, load_latency_s: float = 0.0) -> bool:
    """True when loading `num_tokens` cached tokens from the tier is expected to be faster than computing them.
    A rate not measured yet (None) counts for loading: the first loads measure the tier."""
    if prefill_s_per_token is None or tier_bytes_per_s is None:
        return True
    load = load_latency_s + num_tokens * bytes_per_token / tier_bytes_per_s
    return load < num_tokens * prefill_s_per_token
