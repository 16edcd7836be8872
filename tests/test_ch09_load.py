"""Chapter 09 — the load generator (nanoserve/bench/load.py): gamma arrivals and an open loop.

Graded: `make grade CH=09` runs them against exercises/09-measuring/load.py.

- 9.4 arrivals: a hypothesis property test over rates, shapes and seeds — the mean gap is 1 / rate and the
  squared coefficient of variation of the gaps is 1 / shape (gamma(k, θ): mean kθ, variance kθ²), checked on
  20,000 gaps at tolerances many standard errors wide; the first arrival at 0, times never decreasing, the same
  seed the same schedule, rate inf all at once.
- 9.5 the open loop, with a fake `send` (no server) on a fake clock (an event loop whose clock jumps to its next
  timer instead of sleeping): every request is sent exactly at its schedule, neither earlier nor later, without
  waiting for replies; with max_concurrency the pool holds requests back exactly until a reply frees a seat, and
  each client wait is the send minus the schedule — all hand-computed. No wall clock is read, so a loaded
  machine changes nothing; a last test shows the checks fail a loop that sends late.
"""

import asyncio
import math
import selectors
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
    assert mean == pytest.approx(1 / rate, rel=0.08)  # ~ 8 standard errors at shape 0.5 (CV √2 over 20,000 gaps: 1 %)
    assert statistics.pvariance(gaps) / mean**2 == pytest.approx(1 / burstiness, rel=0.25)


@pytest.mark.exercise("9.4")
def test_arrivals_are_reproducible_and_inf_is_all_at_once():
    arrival_times = load().arrival_times
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 2.0, 0.5, seed=3) == arrival_times(50, 2.0, 0.5, seed=3) != arrival_times(50, 2.0, 0.5, 4)
    # burstier is clumpier: at the same rate, shape 0.25 leaves more of the gaps near 0 than shape 4
    short = [sum(b - a < 0.05 for a, b in zip(t, t[1:])) for t in (arrival_times(2000, 1.0, k, 0) for k in (0.25, 4))]
    assert short[0] > 5 * short[1]


class FakeClock(selectors.DefaultSelector):
    """The event loop's selector, on a clock of its own: where the loop would block until its next timer, the
    clock jumps to it instead. So `asyncio.sleep(d)` takes exactly d on this clock and no time at all on the
    wall's, and every send time below is exact, whatever else the machine is doing."""

    def __init__(self):
        super().__init__()
        self.now, self.spins = 0.0, 0

    def select(self, timeout=None):
        ready = super().select(0)  # the loop's own wake-up pipe: never block on it
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("deadlock: nothing is scheduled and nothing can wake the loop")
        if timeout > 0:
            self.now += timeout  # the loop sleeps until its next timer: jump there
            self.spins = 0
        else:
            self.spins += 1
            if self.spins > 100_000:
                raise RuntimeError("open_loop spins without sleeping: await asyncio.sleep(until the next send)")
        return []


class FakeClockLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.clock = FakeClock()
        super().__init__(self.clock)

    def time(self):
        return self.clock.now


def run_loop(open_loop, schedule, reply_s, max_concurrency=None):
    """open_loop with a fake send that takes reply_s, on the fake clock (time.perf_counter reads it too); returns
    (results, waits, duration, sends) where sends[i] = (time of the send after the start, replies back by then)."""
    sends, replies, done = {}, [0], [0]

    async def send(i):
        sends[i] = (time.perf_counter(), replies[0])
        await asyncio.sleep(reply_s)
        replies[0] += 1
        return f"reply {i}"

    loop = FakeClockLoop()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "perf_counter", loop.time)
        try:
            results, waits, duration = loop.run_until_complete(
                open_loop(schedule, send, max_concurrency, on_done=lambda: done.__setitem__(0, done[0] + 1)))
        finally:
            loop.close()
    assert done[0] == len(schedule)
    return results, waits, duration, sends


def exactly(x):
    return pytest.approx(x, abs=1e-9)


def check_on_schedule(open_loop):
    """Sent on the schedule, by hand: 1 s replies, no cap. A closed loop would send request 1 at 1.0 s (after
    the first reply); a late one, after its time; an early one, before it."""
    schedule = [0.0, 0.25, 0.5, 0.5, 1.75]
    results, waits, duration, sends = run_loop(open_loop, schedule, reply_s=1.0)
    assert results == [f"reply {i}" for i in range(5)]  # in request order
    assert [sends[i][0] for i in range(5)] == [exactly(at) for at in schedule], "sent off the schedule"
    assert [sends[i][1] for i in range(4)] == [0, 0, 0, 0]  # none waited for a reply
    assert waits == [exactly(0)] * 5  # nothing held them back
    assert duration == exactly(1.75 + 1.0)  # the last reply


def check_the_cap(open_loop):
    """At most 2 in flight, 1 s replies: requests 2 and 3 (due at 0.1 and 0.2 s) wait for the first two
    replies (at 1.0 s) and are sent then, having waited 0.9 and 0.8 s; request 4 (due at 3.0 s) finds the pool
    free."""
    schedule = [0.0, 0.0, 0.1, 0.2, 3.0]
    results, waits, duration, sends = run_loop(open_loop, schedule, reply_s=1.0, max_concurrency=2)
    assert results == [f"reply {i}" for i in range(5)]
    assert [sends[i][0] for i in range(5)] == [exactly(t) for t in (0.0, 0.0, 1.0, 1.0, 3.0)]
    assert waits == [exactly(w) for w in (0.0, 0.0, 0.9, 0.8, 0.0)]  # each: its send minus its schedule
    assert duration == exactly(4.0)


@pytest.mark.exercise("9.5")
def test_requests_go_out_on_the_schedule_not_on_the_replies():
    check_on_schedule(load().open_loop)


@pytest.mark.exercise("9.5")
def test_the_concurrency_cap_holds_requests_back_and_says_how_long():
    check_the_cap(load().open_loop)


@pytest.mark.exercise("9.5")
def test_an_empty_schedule_sends_nothing():
    results, waits, duration, sends = run_loop(load().open_loop, [], 0.1)
    assert results == [] and waits == [] and sends == {} and duration == exactly(0)


def test_the_checks_catch_a_loop_that_sends_late():
    """The graded checks fail an open loop that sends every request 0.5 s late, even one that reports the
    lateness honestly as client wait (the reference, behind a late send)."""
    from nanoserve.bench import load as reference

    async def late_open_loop(schedule, send, max_concurrency=None, on_done=None):
        async def late(i):
            await asyncio.sleep(0.5)
            return await send(i)

        results, waits, duration = await reference.open_loop(schedule, late, max_concurrency, on_done)
        return results, [w + 0.5 for w in waits], duration

    for check in (check_on_schedule, check_the_cap):
        check(reference.open_loop)
        with pytest.raises(AssertionError):
            check(late_open_loop)
