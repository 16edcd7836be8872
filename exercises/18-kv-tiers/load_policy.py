"""Exercise 18.2 — load or recompute (mirrors nanoserve/kv/load_policy.py).

Tokens found in the second tier can be loaded (their bytes read at the tier's bandwidth, after a fixed
latency) or recomputed (their share of a prefill). The engine measures both rates while it serves and asks
this function, for every tier hit, which is cheaper.
"""


def should_load(num_tokens: int, bytes_per_token: float, prefill_s_per_token: float | None,
                tier_bytes_per_s: float | None, load_latency_s: float = 0.0) -> bool:
    """Exercise 18.2. True when loading `num_tokens` tokens from the tier is expected to take less time than
    computing them again.

    loading costs load_latency_s plus the tokens' bytes over tier_bytes_per_s; recomputing costs
    prefill_s_per_token per token. Equal costs: recompute (False). A rate that is None has not been measured
    yet: return True (loading is how the tier's rate gets measured).

    >>> should_load(64, 46_080, 0.0005, 1e9, 0.001)     # 0.001 + 64 · 46 µs = 3.9 ms < 64 · 0.5 ms = 32 ms
    True
    >>> should_load(1, 46_080, 0.0005, 1e9, 0.001)      # 1.05 ms > 0.5 ms
    False
    """
    raise NotImplementedError("Exercise 18.2: should_load")
