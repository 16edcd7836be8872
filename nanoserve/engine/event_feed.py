"""Chapter 12 — the engine event feed: snapshots for whoever watches, at no cost when nobody does.

    feed = EventFeed()                                  # the engine thread calls, after every step:
    feed.record(engine, scheduler_output, outputs, step_seconds)
    sub = feed.subscribe(notify=wake_me)                # a viewer (any thread)
    snap = sub.take()                                   # the latest snapshot, or None

Four promises, each one line of the design:

  nearly off  with no subscribers record() builds no snapshot: it keeps the step's record (eight
           numbers, step_record) in a ring of the last HISTORY_STEPS, dropping the oldest
           (`python -m nanoserve bench engine-view` measures it against no feed at all).
  history  a viewer's first snapshot carries that ring as its step records, so a page opened
           mid-run draws the last HISTORY_STEPS steps at once, not an empty timeline.
  throttled  a full snapshot is built at most once per `min_interval` (0.05 s: 20 a second); the
           steps in between only add a few numbers each to the next one's step records.
  bounded  a subscriber holds ONE snapshot. A new one replaces it (counted in `dropped`), so a slow
           viewer skips to the latest state; the engine never waits for a viewer, and memory does not
           grow with how far behind it is.

After the last step of a burst the engine goes idle; `flush` (called by the idle engine loop) sends
the final state, so a viewer sees the pool empty again rather than the last throttled frame. Aborts that
leave the engine idle happen between steps, with no step to record them: the loop calls `changed` first.

Exercise 12.3 writes the mailbox (`Subscription.put`, `Subscription.take`), 12.4 the throttle
(`EventFeed.emit_if_due`); with --student 12 the async engine builds the learner's EventFeed.
"""

import threading
import time
import warnings
from collections import deque

from nanoserve.engine.snapshot import HISTORY_STEPS, SnapshotBuilder, step_record


def _rules(engine):
    """With chapter 12 selected in --student: the learner's block_owners and step_kind (exercises/12-engine-view/),
    once written."""
    return engine.student.module("nanoserve.engine.snapshot")


def _builder(engine, t0: float | None = None) -> SnapshotBuilder:
    return SnapshotBuilder(engine, _rules(engine), t0)


class Subscription:
    """One viewer's mailbox: the latest snapshot only."""

    def __init__(self, notify=None):
        self._lock = threading.Lock()
        self._latest: dict | None = None
        self._notify = notify  # called (from the engine thread) when the mailbox goes from empty to full
        self.dropped = 0  # snapshots replaced before the viewer took them

    def put(self, snap: dict) -> None:
        """Exercise 12.3: the engine thread delivers `snap`; it replaces an untaken one (counted in dropped).
        notify() once per empty -> full, outside the lock."""
        with self._lock:
            was_empty = self._latest is None
            self.dropped += not was_empty
            self._latest = snap
        if was_empty and self._notify is not None:  # a full mailbox already has a wake-up on its way
            self._notify()

    def take(self) -> dict | None:
        """Exercise 12.3: the viewer's thread takes the latest snapshot (the mailbox is then empty), or None."""
        with self._lock:
            snap, self._latest = self._latest, None
        return snap


class EventFeed:
    subscription = Subscription  # the mailbox class each viewer gets (a learner's EventFeed names its own)

    def __init__(self, min_interval: float = 0.05, clock=time.perf_counter):
        """min_interval: seconds between two snapshots at least (0.05: at most 20 a second); clock: seconds,
        monotonic (a test passes a fake one)."""
        self.min_interval = min_interval
        self.clock = clock
        self._lock = threading.Lock()
        self._subscribers: tuple[Subscription, ...] = ()  # replaced, never mutated: the engine reads it unlocked
        self._builder: SnapshotBuilder | None = None
        self._last_emit = float("-inf")
        self._pending = False  # steps observed since the last snapshot, a new viewer, or a change between steps
        self.t0 = time.time()  # the origin of every step record's time, the history's and the snapshots'
        self.history: deque[list] = deque(maxlen=HISTORY_STEPS)  # the last steps' records, watched or not

    @property
    def watched(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, notify=None) -> Subscription:
        sub = self.subscription(notify)
        with self._lock:
            if not self._subscribers:  # nobody watched until now: a fresh builder, so that this viewer sees no
                self._builder = None  # stale ids, counters or latencies (the engine thread makes the next one)
            self._subscribers = (*self._subscribers, sub)
        self._pending = True  # a new viewer gets the current state at the engine's next boundary
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not sub)

    # ---- the engine thread ---------------------------------------------------------------------------
    def record(self, engine, scheduler_output, outputs, step_seconds: float) -> None:
        """After every step. Nobody watching: the step's record goes into the history, nothing else happens."""
        try:
            if not self._subscribers:
                record, _ = step_record(engine, scheduler_output, outputs, step_seconds, self.t0,
                                        _rules(engine).step_kind)
                self.history.append(record)  # a full deque drops its oldest: O(1), memory bounded
                return
            builder = self._builder  # read once: a viewer that arrives when nobody watches sets it to None
            if builder is None:
                builder = self._builder = _builder(engine, self.t0)
            self.history.append(builder.observe_step(scheduler_output, outputs, step_seconds))
            self._pending = True
            self.emit_if_due(engine)
        except NotImplementedError:  # an exercise stub (only a test runs one: serving falls back to the reference)
            raise
        except Exception as e:  # noqa: BLE001 — a bug in the view (say a learner's block_owners) must not stop serving
            self._failed(e)

    def changed(self) -> None:
        """The engine changed between two steps (aborts that left it idle): the next flush sends a snapshot."""
        self._pending = True

    def flush(self, engine) -> float | None:
        """When the engine is idle: send what is pending as soon as the throttle allows. Returns the
        seconds until it may (the idle loop sleeps at most that long), or None when nothing is pending."""
        if not self._subscribers or not self._pending:
            return None
        try:
            wait = self.emit_if_due(engine)  # which makes the builder if a new viewer's subscribe dropped it
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None
        return wait if self._pending else None

    def _failed(self, error: Exception) -> None:
        """Drop the builder (the next step starts a fresh one) and say why; the engine goes on."""
        self._builder, self._pending = None, False
        warnings.warn(f"the engine event feed failed, a snapshot is skipped: {error!r}")

    def emit_if_due(self, engine) -> float:
        """Exercise 12.4: if min_interval has passed since the last snapshot (self._last_emit, by self.clock),
        build one (self._builder, made for `engine` if None) and put it in every subscriber's mailbox, clear
        self._pending and return 0.0; else build nothing and return the seconds until one may be built."""
        now = self.clock()
        wait = self._last_emit + self.min_interval - now
        if wait > 0:
            return wait
        builder = self._builder
        if builder is None:
            builder = self._builder = _builder(engine, self.t0)
        snap = builder.snapshot()
        self._last_emit, self._pending = now, False
        for sub in self._subscribers:
            sub.put(snap)  # the same dict for all: viewers only read it
        return 0.0

    # ---- a viewer's thread ---------------------------------------------------------------------------
    def with_history(self, snap: dict) -> dict:
        """A viewer's first snapshot: `snap` with the history up to its step as its step records (every
        observed step went into both, so they end alike). Any thread: deque.copy() runs in C under the GIL,
        whole, so the engine thread's appends cannot tear it."""
        return {**snap, "steps": [r for r in self.history.copy() if r[0] <= snap["step"]]}
