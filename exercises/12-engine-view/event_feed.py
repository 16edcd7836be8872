"""Exercises 12.3 and 12.4 — the event feed's two promises: one snapshot per viewer, at most R a second.

This file mirrors the two classes of nanoserve/engine/event_feed.py (read its docstring for the picture,
not its code). Your classes inherit the reference's, so everything but your three methods is given:
`Subscription.__init__` sets `self._lock` (a threading.Lock), `self._latest` (the mailbox: a snapshot or
None), `self._notify` (a callable or None) and `self.dropped` (0); `EventFeed.__init__` sets
`self.min_interval`, `self.clock`, `self._subscribers` (a tuple), `self._builder` (a SnapshotBuilder or
None), `self._last_emit` (-inf), `self._pending`, `self.t0` (the origin of the snapshots' times) and
`self.history` (the last steps' records, kept by the given `record`); `_builder(engine, self.t0)` makes a builder.

Grade with `make grade CH=12 EX=12.3` (or 12.4); with `--student 12` the server's live page is fed by yours.
"""

from nanoserve.engine import event_feed
from nanoserve.engine.event_feed import _builder  # noqa: F401  (given: a SnapshotBuilder for an engine)


class Subscription(event_feed.Subscription):
    def put(self, snap: dict) -> None:
        """Exercise 12.3: the engine thread delivers `snap`. The viewer must only ever find the latest snapshot
        (never a queue of them, however slow it reads); one replaced before it was taken adds 1 to dropped.
        notify(), if set, is called once each time the mailbox goes from empty to full — not while it stays
        full — and outside the lock. Safe against take() running in another thread."""
        raise NotImplementedError("Exercise 12.3: Subscription.put")

    def take(self) -> dict | None:
        """Exercise 12.3: the viewer's thread takes the latest snapshot, leaving the mailbox empty; None if
        it is empty."""
        raise NotImplementedError("Exercise 12.3: Subscription.take")


class EventFeed(event_feed.EventFeed):
    subscription = Subscription  # the mailbox each viewer gets: yours

    def emit_if_due(self, engine) -> float:
        """Exercise 12.4: the throttle. The given record() calls it after every watched step, flush() when the
        engine is idle; both only while something is pending (self._pending).

        Promises: snapshots are built at most one per min_interval seconds of self.clock() (the first at once),
        from self._builder (None: there is none yet; _builder(engine, self.t0) makes one). Each one built reaches
        every subscriber's mailbox, as one dict for all, and leaves nothing pending. Returns 0.0 when it built
        one, else the seconds until one may be built (flush hands that to the idle loop as its longest sleep).

        Example, min_interval 0.05: calls at clock 100.00, 100.01 and 100.06 build at 100.00 and 100.06; the one
        at 100.01 builds nothing and returns 0.04."""
        raise NotImplementedError("Exercise 12.4: EventFeed.emit_if_due")
