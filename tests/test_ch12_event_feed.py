"""Chapter 12 — the event feed's mailbox and throttle (nanoserve/engine/event_feed.py), without a server.

Graded: `make grade CH=12` runs them against exercises/12-engine-view/event_feed.py.

- 12.3 the mailbox: a viewer only ever finds the latest snapshot, the ones it missed are counted, it is woken
  once per empty -> full, outside the lock, and a reader against a writer in two threads gets the snapshots in
  order, none twice, the last one always, and every other one counted as dropped.
- 12.4 the throttle, on a fake clock and a fake snapshot builder: with steps every millisecond for a simulated
  second, at most R + 1 snapshots are built (R = 1 / min_interval), each subscriber gets the same dict, and
  flush says how long until the next one may go.
- not graded: the given `record` builds nothing for steps nobody watches (it never calls emit_if_due then).
"""

import importlib
import threading
from types import SimpleNamespace

import pytest

from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.student import implementation


def feed_module():
    return implementation("nanoserve.engine.event_feed")


@pytest.mark.exercise("12.3")
def test_the_mailbox_keeps_the_latest_only_and_counts_what_it_dropped():
    woken = []
    sub = feed_module().Subscription(notify=lambda: woken.append(1))
    assert sub.take() is None
    for i in range(3):
        sub.put({"step": i})
    assert len(woken) == 1  # one wake-up for empty -> full, none while it stays full
    assert sub.take() == {"step": 2} and sub.dropped == 2
    assert sub.take() is None
    sub.put({"step": 3})
    assert len(woken) == 2 and sub.take() == {"step": 3} and sub.dropped == 2


@pytest.mark.exercise("12.3")
def test_the_wake_up_comes_outside_the_lock():
    """notify() runs the viewer's code (the server's posts a wake-up to its event loop): under the mailbox's lock it
    would hold up the viewer's take(), or deadlock a notify that takes at once (a threading.Lock is not re-entrant)."""
    free = []

    def notify():
        got = sub._lock.acquire(blocking=False)  # held by put() while it calls us: False
        if got:
            sub._lock.release()
        free.append(got)

    sub = feed_module().Subscription(notify=notify)
    sub.put({"step": 0})
    assert free == [True]


@pytest.mark.exercise("12.3")
def test_a_writer_and_a_reader_in_two_threads_lose_nothing_uncounted():
    sub = feed_module().Subscription()
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set() or sub._latest is not None:
            snap = sub.take()
            if snap is not None:
                seen.append(snap["step"])

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(5000):
        sub.put({"step": i})
    stop.set()
    thread.join(60)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # in order, never twice
    assert seen[-1] == 4999  # the last state always arrives
    assert len(seen) + sub.dropped == 5000  # every snapshot either taken or counted as dropped


class FakeBuilder:
    def __init__(self):
        self.observed = self.built = 0

    def observe_step(self, *args):
        self.observed += 1
        return [self.observed]  # the step's record

    def snapshot(self):
        self.built += 1
        return {"snapshot": self.built}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def fed(min_interval=0.05, viewers=2, module=None):
    clock, builder = Clock(), FakeBuilder()
    feed = (module or feed_module()).EventFeed(min_interval, clock)
    subs = [feed.subscribe() for _ in range(viewers)]
    feed._builder = builder  # no engine: the builder is given
    return feed, subs, clock, builder


@pytest.mark.exercise("12.4")
def test_at_most_r_snapshots_a_second_however_fast_the_steps():
    feed, subs, clock, builder = fed(min_interval=0.05)
    got = [[] for _ in subs]
    for _ in range(1000):  # a step every millisecond, for one second
        feed.record(None, None, [], 0.001)
        for sub, mine in zip(subs, got):
            if (snap := sub.take()) is not None:
                mine.append(snap)
        clock.now += 0.001
    assert builder.observed == 1000  # every step observed ...
    assert 20 <= builder.built <= 21  # ... but at most 1 / 0.05 = 20 snapshots a second built (+1 at t = 0)
    assert got[0] == got[1] and [s["snapshot"] for s in got[0]] == list(range(1, builder.built + 1))
    assert got[0][0] is not None and all(a is b for a, b in zip(*got))  # the same dict for every viewer


@pytest.mark.exercise("12.4")
def test_flush_says_how_long_until_the_next_snapshot_may_go():
    feed, (sub, _), clock, builder = fed(min_interval=0.1)
    feed.record(None, None, [], 0.001)  # the first snapshot goes at once
    assert builder.built == 1 and sub.take() == {"snapshot": 1}
    clock.now += 0.03
    feed.record(None, None, [], 0.001)  # too soon: pending, nothing built
    assert builder.built == 1 and sub.take() is None
    assert feed.flush(None) == pytest.approx(0.07)  # the idle loop sleeps that long at most
    clock.now += 0.07
    assert feed.flush(None) is None and builder.built == 2 and sub.take() == {"snapshot": 2}  # the final state
    assert feed.flush(None) is None and builder.built == 2  # nothing pending: nothing built


def test_nothing_is_built_for_steps_nobody_watches():
    """The given `record` and `flush`, not an exercise (so the reference's, also under `make grade`): with no
    subscriber they keep each step's record and never reach emit_if_due; a viewer that comes back gets a snapshot
    at the next step."""
    feed, subs, clock, builder = fed(module=importlib.import_module("nanoserve.engine.event_feed"))
    for sub in subs:
        feed.unsubscribe(sub)
    # an idle engine stepped by hand: nothing scheduled, a 4-block pool with 1 block held
    reference = SimpleNamespace(module=importlib.import_module)  # --student off: the reference's step_kind
    engine = SimpleNamespace(num_steps=0, student=reference,
                             block_manager=SimpleNamespace(num_blocks=4, get_num_free_blocks=lambda: 3))
    for _ in range(10):
        engine.num_steps += 1
        feed.record(engine, SchedulerOutput(), [], 0.001)
        clock.now += 1
    assert builder.built == 0 and builder.observed == 0 and feed.flush(None) is None
    # only the steps' records are kept, for the next viewer: [step, time, prefill, decode, seqs, ms, new tokens, usage]
    assert [r[0] for r in feed.history] == list(range(1, 11))
    assert all(r[2:] == [0, 0, 0, 1.0, 0, 0.25] for r in feed.history)
    sub = feed.subscribe()  # a viewer comes back: the next step builds for it
    feed._builder = builder
    feed.record(None, None, [], 0.001)
    assert builder.built == 1 and sub.take() == {"snapshot": 1}
