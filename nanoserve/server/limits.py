"""Chapter 08 — a token-bucket rate limit, one bucket per API key (or per client address).

Each bucket holds up to `burst` tokens and refills at `rate` tokens per second; a request takes
one. With rate=2, burst=3: three requests at once pass, the fourth is refused (429) and told to
retry in 0.5 s, when the next token has dripped in.

    >>> limiter = TokenBucketLimiter(rate=2, burst=3)
    >>> [limiter.try_acquire("k", now=0.0) for _ in range(4)]
    [0.0, 0.0, 0.0, 0.5]
"""

import time


class TokenBucketLimiter:
    def __init__(self, rate: float, burst: int):
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate, self.burst = rate, burst
        self.buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, time of the last update)

    def try_acquire(self, key: str, now: float | None = None) -> float:
        """Take a token for `key`: 0.0 if granted, else the seconds until one will be there."""
        now = time.monotonic() if now is None else now
        tokens, last = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1:
            self.buckets[key] = (tokens - 1, now)
            return 0.0
        self.buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate
