"""Chapter 09 — the load generator's two ideas: when requests arrive, and sending them on time.

    schedule = arrival_times(64, rate=4.0, burstiness=1.0, seed=0)   # seconds after the start
    results, waits, duration = asyncio.run(open_loop(schedule, send, max_concurrency=16))

**Arrivals** (`arrival_times`): request i is scheduled at the sum of i gaps drawn from a gamma
distribution of shape k = burstiness and mean 1 / rate, as `vllm bench serve` draws them. Gamma(k, θ)
has mean kθ and variance kθ², so θ = 1 / (rate · k) keeps the mean gap 1 / rate whatever k is, and the
squared coefficient of variation of the gaps, variance / mean², is 1 / k: k = 1 is a Poisson process
(exponential gaps, CV² = 1), k < 1 burstier (clusters and lulls), k > 1 steadier. rate = inf: all at 0.

**An open loop** (`open_loop`): request i is *sent* at t0 + schedule[i], whether or not earlier requests
have been answered: real users do not wait for each other. A closed loop — send the next request when a
reply comes — lets a slow server slow down its own load, so the requests that would have queued behind a
stall are never sent during it and never measured: coordinated omission (Gil Tene's name). The one
sanctioned hold-back is `max_concurrency` (a pool of that many users): a request that finds the pool full
waits in the client; its latency is timed from its real send, and the wait is returned apart, so an
overloaded server cannot hide its queue in the load generator's.

    >>> arrival_times(3, float("inf"), 1.0, seed=0)
    [0.0, 0.0, 0.0]
"""

import asyncio
import math
import random
import time


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Exercise 9.4: seconds after the start at which each of `num` requests is scheduled: 0, then cumulative
    gamma(shape burstiness, mean 1 / rate) gaps from random.Random(seed); all 0.0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng, t, times = random.Random(seed), 0.0, []
    theta = 1.0 / (rate * burstiness)  # gamma(shape k, scale θ) has mean k·θ = 1 / rate
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, theta)
    return times


async def open_loop(schedule: list[float], send, max_concurrency: int | None = None, on_done=None):
    """Exercise 9.5: `await send(i)` for request i at t0 + schedule[i] (t0: this call's start, time.perf_counter),
    never earlier, and never later than the schedule for any reason but `max_concurrency` sends already in
    flight (None: no cap). on_done(), if given, after each reply. Returns (the sends' results in request order,
    each request's client wait in seconds — its actual send minus its scheduled time —, the run's duration)."""
    t0 = time.perf_counter()
    pool = asyncio.Semaphore(max_concurrency or max(1, len(schedule)))

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))  # the schedule, not the replies
        due = t0 + at
        async with pool:
            waited = max(0.0, time.perf_counter() - due)
            result = await send(i)
        if on_done is not None:
            on_done()
        return result, waited

    done = await asyncio.gather(*(one(i, at) for i, at in enumerate(schedule)))
    duration = time.perf_counter() - t0
    return [r for r, _ in done], [w for _, w in done], duration
