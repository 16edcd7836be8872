"""Chapter 16 — publish the prefix cache's events (kv/kv_events.py) in vLLM's wire format.

vLLM's `--kv-events-config` publisher, which llm-d's and Dynamo's KV-aware routers subscribe to:
a ZMQ PUB socket, one multipart message per batch,

    [topic (bytes), sequence number (8 bytes, big-endian), msgpack payload]
    payload = [ts, [event, ...]]                         (msgspec's array_like EventBatch)
    event   = ["BlockStored", [hash], parent_hash, token_ids, block_size, lora_id, medium, lora_name]
              ["BlockRemoved", [hash], medium]
              ["AllBlocksCleared"]

The fields in the order of vLLM's `BlockStored` struct, which msgspec packs as an array (omitting trailing
fields left at their default: vLLM's extra_keys and group_idx, which nanoserve never sets). A block computed
under a LoRA adapter (chapter 19) carries its id and name; the base model's carries None, None. (The newest
vLLM packs each event as a map of the same named fields instead of an array.)

Hashes travel as bytes: chapter 05's hashes are 256-bit SHA-256 ints, wider than msgpack's
integers, and vLLM's own SHA-256 block hashes go out as bytes too (32 bytes, here little-endian).

    publisher = KVEventPublisher(log, "tcp://127.0.0.1:5557")   # a thread: every 50 ms, what the log holds
    publisher.close()
"""

import threading
import time

import msgpack
import zmq

from nanoserve.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog


def hash_bytes(h: int | None) -> bytes | None:
    return None if h is None else h.to_bytes(32, "little")


def encode_event(event) -> list:
    """One event as vLLM's tagged array: the class name first, then the fields in order."""
    if isinstance(event, BlockStored):
        return ["BlockStored", [hash_bytes(h) for h in event.block_hashes], hash_bytes(event.parent_block_hash),
                event.token_ids, event.block_size, event.lora_id, event.medium, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [hash_bytes(h) for h in event.block_hashes], event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list, ts: float) -> bytes:
    return msgpack.packb([ts, [encode_event(e) for e in events]], use_bin_type=True)


class KVEventPublisher:
    def __init__(self, log: KVEventLog, endpoint: str, topic: str = "", interval_s: float = 0.05):
        """endpoint: where the PUB socket binds, e.g. "tcp://127.0.0.1:5557" (vLLM's default port) or
        "tcp://127.0.0.1:*" for a free one (then see `self.endpoint`)."""
        self.log, self.topic, self.interval_s = log, topic.encode(), interval_s
        self.context = zmq.Context.instance()  # shared, never terminated: a context of its own, garbage-collected
        # while one of its sockets is still open, would block this process for ever in its term()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.socket.close()
            raise ValueError(f"cannot bind the KV-events socket to {endpoint!r}: {e}") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self._lock = threading.Lock()  # flush() from a caller's thread and from ours: a ZMQ socket is not thread-safe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-kv-events", daemon=True)
        self._thread.start()

    def flush(self) -> int:
        """Send what the log holds as one batch now; returns the number of events sent."""
        with self._lock:
            if self.socket.closed:  # a caller's flush racing close()
                return 0
            events = self.log.take()
            if events:
                payload = encode_batch(events, time.time())
                self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
                self.seq += 1
            return len(events)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
        with self._lock:
            # the last batches (the flush just above) may still wait in the socket's queue: LINGER 0 (set at bind, so
            # that an unread socket never holds anything up) would drop them at close, so give them a second to go
            self.socket.close(linger=1000)
