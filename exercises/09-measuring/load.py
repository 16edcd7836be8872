"""Exercises 9.4 and 9.5 — the load generator: when requests arrive, and sending them on time.

This file mirrors nanoserve/bench/load.py (read its docstring for the picture, not its code).
`bench serve --student` runs the rungs you have finished (the reference's stand in for the others).
Grade with `make grade CH=09 EX=9.4` (or 9.5).
"""

import asyncio  # noqa: F401
import math  # noqa: F401
import random  # noqa: F401
import time  # noqa: F401


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Exercise 9.4: seconds after the start at which each of `num` requests is scheduled: 0, then cumulative
    gamma(shape burstiness, mean 1 / rate) gaps from random.Random(seed); all 0.0 when rate is inf.

    arrival_times(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]
    arrival_times(20_000, rate=4.0, burstiness=0.5, seed=1): 20,000 times from 0.0, never decreasing, the same for
    the same seed; their gaps average 1 / 4 = 0.25 s, with a squared coefficient of variation of 1 / 0.5 = 2"""
    raise NotImplementedError("Exercise 9.4: arrival_times")


async def open_loop(schedule: list[float], send, max_concurrency: int | None = None, on_done=None):
    """Exercise 9.5: `await send(i)` for request i at t0 + schedule[i] (t0: this call's start, time.perf_counter),
    never earlier, and never later than the schedule for any reason but `max_concurrency` sends already in
    flight (None: no cap). on_done(), if given, after each reply. Returns (the sends' results in request order,
    each request's client wait in seconds — its actual send minus its scheduled time —, the run's duration).

    schedule [0.0, 0.0, 0.1], a send that takes 1 s, max_concurrency=2: requests 0 and 1 are sent at 0.0, request 2
    at 1.0 (when a reply frees a seat, 0.9 s after its schedule) -> ([reply 0, reply 1, reply 2], [0.0, 0.0, 0.9], 2.0)"""
    raise NotImplementedError("Exercise 9.5: open_loop")
