"""Chapter 17 — the transport between a prefill and a decode process: shared memory for the tensors, ZMQ
for control.

A request's KV travels through one POSIX shared-memory segment (/dev/shm on Linux) laid out layer-major,
so the producer can fill it layer by layer while the prefill computes the next layer, and the consumer can
load layer i before its own layer i runs:

    segment "nskv_3f2a…"  float32 (num_layers, 2, num_kv_heads, num_tokens, head_dim)
    SmolLM2, a 100-token prompt: 30 · 2 · 3 · 100 · 64 · 4 B = 4.6 MB (46,080 B per token, chapter 04)

The segment belongs to the producer (StagingArea): it creates it, and unlinks it when the consumer says it
has loaded it — a "release" message on the producer's ZMQ PULL socket — or when nobody asked for it within
the release timeout (a proxy that died between the two halves). The consumer only opens, copies and closes.
Both are one machine here; across machines the segment would be an RDMA region (vLLM's NIXL connector) and
the messages the same.
"""

import threading
import time
from multiprocessing import resource_tracker, shared_memory

import torch
import zmq


CREATED_HERE: set[str] = set()  # segments this process's StagingAreas hold (both engines may share one process)


def staged_view(shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The segment as a (num_layers, 2, Hkv, num_tokens, D) tensor (no copy)."""
    count = 1
    for s in shape:
        count *= s
    return torch.frombuffer(shm.buf, dtype=dtype, count=count).view(shape)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


class StagingArea:
    """The producer's segments, and the thread that frees them on a consumer's release (or a timeout)."""

    def __init__(self, endpoint: str, release_timeout_s: float):
        self.release_timeout_s = release_timeout_s
        self.segments: dict[str, tuple[shared_memory.SharedMemory, float]] = {}  # name -> (segment, created at)
        self.lock = threading.Lock()  # the engine thread creates, the control thread frees
        self.context = zmq.Context.instance()  # shared, never terminated: a context of its own, garbage-collected
        # while one of its sockets is still open, would block this process for ever in its term()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.socket.close()
            raise ValueError(f"cannot bind the KV control endpoint {endpoint}: {e}") from None
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="nanoserve-kv-control", daemon=True)
        self.thread.start()

    def create(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes(shape, dtype))
        with self.lock:
            self.segments[name] = (shm, time.monotonic())
            CREATED_HERE.add(name)
        return staged_view(shm, shape, dtype)

    def release(self, name: str) -> bool:
        """Free a segment (the consumer loaded it, or it timed out); False for a name not held (freed already)."""
        with self.lock:
            entry = self.segments.pop(name, None)
            CREATED_HERE.discard(name)
        if entry is None:
            return False
        entry[0].close()  # every view of it is gone: the engine thread dropped its tensor after the save
        entry[0].unlink()
        return True

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.stopped.is_set():
            if poller.poll(200):
                self.release(self.socket.recv_string())
            now = time.monotonic()
            with self.lock:
                stale = [n for n, (_, t) in self.segments.items() if now - t > self.release_timeout_s]
            for name in stale:
                self.release(name)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        for name in list(self.segments):
            self.release(name)
        self.socket.close()


def open_staged(name: str) -> shared_memory.SharedMemory:
    """The consumer's handle on a producer's segment (FileNotFoundError if it is gone). Python's resource
    tracker would unlink it when this process exits, as if it were ours: it is the producer's, so untrack it
    (unless the producer is this very process: then the tracker entry is the producer's own)."""
    shm = shared_memory.SharedMemory(name=name)
    if name not in CREATED_HERE:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 — the tracker knows it by this name
    return shm


class ReleaseSender:
    """The consumer's side of the control channel: one PUSH socket per producer endpoint."""

    def __init__(self):
        self.context = zmq.Context.instance()  # shared, never terminated: a context of its own, garbage-collected
        # while one of its sockets is still open, would block this process for ever in its term()
        self.sockets: dict[str, zmq.Socket] = {}

    def release(self, endpoint: str, name: str) -> None:
        if endpoint not in self.sockets:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)  # a release sent just before close still goes out
            socket.connect(endpoint)
            self.sockets[endpoint] = socket
        self.sockets[endpoint].send_string(name)

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close()
