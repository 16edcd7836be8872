"""Exercise 8.4 — backpressure: a token bucket per client, and a bound on the waiting queue; refusals as
429 / 503 with Retry-After.

Mirror of nanoserve/server/limits.py. Read chapter 08, sections 6 and 13, and README.md's design questions
for 8.4. Your TokenBucketLimiter inherits the reference, so its table and helpers are given:

    self.rate, self.burst, self.max_keys
    self.buckets                 OrderedDict key -> (tokens, time of the last update), least recently used first
    self._expire(now)            drop the buckets idle long enough to be full again (oldest first)
    self._store(key, tokens, now)   put a bucket back as the most recently used, dropping the least recently
                                    used ones beyond max_keys

The server calls your try_acquire for every request when it runs with --rate-limit, and your
too_many_requests and check_queue to refuse (nanoserve/server/api_server.py's guard and check_queue).

Grade it:      make grade CH=08 EX=8.4
See it serve:  python -m nanoserve serve --student 08 --rate-limit 1 --rate-burst 2 --max-waiting-requests 4
"""

from nanoserve.server.limits import TokenBucketLimiter as ReferenceTokenBucketLimiter
from nanoserve.server.protocol import APIError  # noqa: F401 — APIError(status, message, headers={...})


def too_many_requests(wait: float, message: str) -> APIError:
    """Exercise 8.4: the 429 for a request that a bucket refused; it will have its tokens in `wait` seconds.

    Its message is `message` followed by "; retry in W s" (W with two decimals), and its Retry-After header the
    wait in whole seconds, never less than what is needed and never 0 (a client told 0 retries at once):

        too_many_requests(0.5, "rate limit of 2 requests/s exceeded")
        -> APIError(429, "rate limit of 2 requests/s exceeded; retry in 0.50 s", headers={"Retry-After": "1"})
    """
    raise NotImplementedError("Exercise 8.4: a 429 with a Retry-After in whole seconds")


def check_queue(num_waiting: int, max_waiting: int | None, retry_after_s: int) -> None:
    """Exercise 8.4: the bound on the waiting queue: requests with no completion running yet (vLLM's nearest,
    --max-num-queued-reqs, counts the running ones too). With `max_waiting` or more requests already waiting
    (None: no bound), raise a 503 whose message says how many wait and the bound, with the header
    Retry-After: `retry_after_s`. Otherwise return."""
    raise NotImplementedError("Exercise 8.4: refuse with 503 when the waiting queue is full")


class TokenBucketLimiter(ReferenceTokenBucketLimiter):
    def try_acquire(self, key: str, now: float | None = None, cost: float = 1.0) -> float:
        """Exercise 8.4: take `cost` tokens from `key`'s bucket at time `now` (None: time.monotonic()).
        Returns 0.0 if granted, else the seconds until the bucket will hold `cost` (nothing is taken then).

        A bucket holds at most `burst` tokens and refills at `rate` per second since its last update; a key
        never seen (or whose bucket expired) has a full one. With rate 2, burst 3, four calls at now=0:
        0.0, 0.0, 0.0, 0.5. The table stays bounded (the helpers above), however many keys come.
        """
        raise NotImplementedError("Exercise 8.4: the token bucket: refill, then take or say how long to wait")
