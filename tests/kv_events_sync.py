"""The KV-event tests' handshake with ZMQ's "slow joiner": a PUB socket drops what it sends before a subscriber's
subscription has reached it, and nothing tells the publisher when that is (a fixed sleep is a guess that a loaded
machine loses). So the test holds the log's events back, sends probes on the publisher's socket until one arrives,
and only then lets the real batches go: every batch is sent to a subscription that is through."""

import time

import msgpack

PROBE = b"-probe"  # a probe's topic: the publisher's own plus this (a subscriber of the topic's prefix gets it too)


def is_probe(topic: bytes) -> bool:
    return topic.endswith(PROBE)


def until_subscribed(publisher, arrived, timeout: float = 60.0) -> None:
    """Send probes on `publisher`'s socket (topic: its own + PROBE, numbered 0, 1, ... so that a subscriber counting
    gaps per topic sees none, an empty batch) until `arrived(timeout_ms)` says one came back. The log's events must
    be held back meanwhile (KVEventLog.take them, append them again after): the real batches start after this."""
    deadline, n = time.monotonic() + timeout, 0
    while True:
        with publisher._lock:  # the publisher's thread may flush at the same time: a ZMQ socket is not thread-safe
            publisher.socket.send_multipart([publisher.topic + PROBE, n.to_bytes(8, "big"),
                                             msgpack.packb([0.0, []], use_bin_type=True)])
        n += 1
        if arrived(100):
            return
        assert time.monotonic() < deadline, f"no subscription reached {publisher.endpoint} in {timeout:.0f} s"


def probe_on(socket):
    """arrived() for a plain SUB socket: whether a probe came within timeout_ms (what came before it is dropped:
    only probes are sent until one arrives)."""
    def arrived(timeout_ms: int) -> bool:
        while socket.poll(timeout_ms):
            topic, *_ = socket.recv_multipart()
            if is_probe(topic):
                return True
        return False

    return arrived
