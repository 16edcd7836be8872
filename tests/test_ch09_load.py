"""Chapter 09 — the load generator (nanoserve/bench/load.py): gamma arrivals and an open loop.

Graded: `make grade CH=09` runs them against exercises/09-measuring/load.py.

- 9.4 arrivals: a hypothesis property test over rates, shapes and seeds — the mean gap is 1 / rate and the
  squared coefficient of variation of the gaps is 1 / shape (gamma(k, θ): mean kθ, variance kθ²), checked on
  20,000 gaps at tolerances many standard errors wide; the first arrival at 0, times never decreasing, the same
  seed the same schedule, rate inf all at once.
- 9.5 the open loop, with a fake `send` (no server): every request is sent no earlier than its schedule, and
  without waiting for replies (each send sees how many replies had come back: none, when the schedule is much
  shorter than a reply); with max_concurrency the pool holds requests back and their client wait is at least the
  replies they waited for. Only lower bounds on times are asserted: a loaded machine can make sleeps longer,
  never shorter.
"""

import asyncio
import math
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.student import implementation


def load():
    return implementation("nanoserve.bench.load")


@pytest.mark.exercise("9.4")
@settings(max_examples=20, deadline=None)
@given(rate=st.floats(0.1, 100.0), burstiness=st.floats(0.5, 8.0), seed=st.integers(0, 2**31))
def test_gaps_have_mean_one_over_rate_and_cv2_one_over_shape(rate, burstiness, seed):
    times = load().arrival_times(20_001, rate, burstiness, seed)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 20_001 and times[0] == 0 and min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.08)  # ~ 5 standard errors at shape 0.5
    assert statistics.pvariance(gaps) / mean**2 == pytest.approx(1 / burstiness, rel=0.25)


@pytest.mark.exercise("9.4")
def test_arrivals_are_reproducible_and_inf_is_all_at_once():
    arrival_times = load().arrival_times
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 2.0, 0.5, seed=3) == arrival_times(50, 2.0, 0.5, seed=3) != arrival_times(50, 2.0, 0.5, 4)
    # burstier is clumpier: at the same rate, shape 0.25 leaves more of the gaps near 0 than shape 4
    short = [sum(b - a < 0.05 for a, b in zip(t, t[1:])) for t in (arrival_times(2000, 1.0, k, 0) for k in (0.25, 4))]
    assert short[0] > 5 * short[1]


def run_loop(schedule, reply_s, max_concurrency=None):
    """open_loop with a fake send that takes reply_s; returns (results, waits, duration, sends) where sends[i] =
    (time of the send after t0, replies back by then)."""
    sends, replies, done = {}, [0], [0]

    async def send(i):
        sends[i] = (time.perf_counter() - t0, replies[0])
        await asyncio.sleep(reply_s)
        replies[0] += 1
        return f"reply {i}"

    t0 = time.perf_counter()
    results, waits, duration = asyncio.run(load().open_loop(schedule, send, max_concurrency,
                                                            on_done=lambda: done.__setitem__(0, done[0] + 1)))
    assert done[0] == len(schedule)
    return results, waits, duration, sends


@pytest.mark.exercise("9.5")
def test_requests_go_out_on_the_schedule_not_on_the_replies():
    schedule = [0.0, 0.01, 0.02, 0.05, 0.05, 0.08]
    results, waits, duration, sends = run_loop(schedule, reply_s=1.0)
    assert results == [f"reply {i}" for i in range(6)]  # in request order
    for i, at in enumerate(schedule):
        sent, replies_back = sends[i]
        assert sent >= at - 1e-3, f"request {i} sent at {sent:.3f} s, before its schedule {at} s"
        assert replies_back == 0, f"request {i} waited for {replies_back} replies: a closed loop"
    assert len(waits) == 6 and min(waits) >= 0 and duration >= 1.0 + 0.08 - 1e-3


@pytest.mark.exercise("9.5")
def test_the_concurrency_cap_holds_requests_back_and_says_how_long():
    reply = 0.2
    results, waits, duration, sends = run_loop([0.0, 0.0, 0.0, 0.0], reply, max_concurrency=2)
    assert results == [f"reply {i}" for i in range(4)]
    order = sorted(range(4), key=lambda i: sends[i][0])
    first, later = order[:2], order[2:]
    assert all(sends[i][1] == 0 for i in first) and all(sends[i][1] >= 1 for i in later)  # a slot freed first
    assert all(waits[i] >= reply - 1e-3 for i in later)  # each waited at least one reply for the pool
    assert all(abs(waits[i] - sends[i][0]) < 0.05 + waits[i] * 0.5 for i in later)  # wait = send - schedule (0)
    assert duration >= 2 * reply - 1e-3


@pytest.mark.exercise("9.5")
def test_an_empty_schedule_sends_nothing():
    results, waits, duration, sends = run_loop([], 0.1)
    assert results == [] and waits == [] and sends == {} and duration >= 0
