"""Chapter 18 — the second tier's bytes: a file of block slots, written in the background, read on a hit.

    pool block b  --offload-->  staging copy (host memory)  --writer thread-->  file slot s
    file slot s   --load----------------------------------------------------->  pool block b'

The file is mapped into memory (torch.from_file(shared=True) is an mmap): slot s is bytes
[s · block_nbytes, (s + 1) · block_nbytes), one block of every layer's K and V (and, for an int8 / fp8
pool, their scales), laid out tensor after tensor. Here the pool lives in host memory already, so the
"device to host" copy is a memcpy and the file is the one slower, larger tier. There is no host-memory tier:
a GPU build would add one (pinned host slots between the GPU pool and the file, as in SGLang's HiCache).

Why a staging copy: an evicted block is handed out for new contents in the very step that evicts it, so its
bytes must be copied out before that step's forward pass writes into it. The copy is quick; the write to the
file is not, and a writer thread does it while the steps go on. A load of a slot whose write is still queued
waits for it (a *stall*, counted). The block manager orders the step's operations (TierIndex, integers);
this class only executes them, in that order.
"""

import os
import queue
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import torch


def block_tensors(pool) -> list[torch.Tensor]:
    """The tensors holding a block's contents, each (Hkv, num_blocks, ...): K and V per layer, and the scales
    of a quantized pool (QuantizedKVCache.block_tensors)."""
    return pool.block_tensors() if hasattr(pool, "block_tensors") else pool.k_cache + pool.v_cache


def block_nbytes(pool) -> int:
    return sum(t[:, 0].numel() * t.element_size() for t in block_tensors(pool))


def read_block(pool, block_id: int) -> torch.Tensor:
    """One block's bytes, (block_nbytes,) uint8, a copy."""
    return torch.cat([t[:, block_id].contiguous().view(torch.uint8).flatten() for t in block_tensors(pool)])


def write_block(pool, block_id: int, data: torch.Tensor) -> None:
    """The inverse of read_block: `data` (block_nbytes,) uint8 into block `block_id`."""
    offset = 0
    for t in block_tensors(pool):
        tile = t[:, block_id]
        n = tile.numel() * t.element_size()
        t.view(torch.uint8)[:, block_id] = data[offset:offset + n].view(tile.view(torch.uint8).shape)
        offset += n


@dataclass
class FileTierStats:
    offloads: int = 0  # blocks copied out of the pool to be written (evicted or swapped out)
    loads: int = 0  # blocks read back into the pool (loaded or swapped in)
    bytes_written: int = 0
    bytes_read: int = 0
    stalls: int = 0  # loads that waited for their slot's write to finish
    stall_seconds: float = 0.0
    load_seconds: float = 0.0  # reading the file into the pool (stall_seconds not included)


class FileKVTier:
    def __init__(self, capacity: int, block_nbytes: int, path: str | None = None):
        """`capacity` slots of `block_nbytes` bytes in a new file at `path` (None: a temporary file); close()
        removes it. An existing file is refused: the tier would overwrite it and then delete it. The file is sized
        at once; its pages are only backed once written."""
        if path is None:
            fd, path = tempfile.mkstemp(prefix="nanoserve-kv-", suffix=".bin")
            os.close(fd)
        elif os.path.exists(path):
            raise ValueError(f"kv_tier_path {path!r} exists: the tier needs a new file (it removes it at exit)")
        self.path, self.capacity, self.block_nbytes = path, capacity, block_nbytes
        self.slots = torch.from_file(path, shared=True, size=capacity * block_nbytes,
                                     dtype=torch.uint8).view(capacity, block_nbytes)
        self.stats = FileTierStats()
        self.pending: dict[int, int] = {}  # slot -> writes queued and not done
        self.error: BaseException | None = None  # the writer's first failure, raised by the next load or flush
        self.done = threading.Condition()
        self.queue: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self.writer.start()
        # the file is removed at exit even if close() never runs (a server whose engine is replaced)
        self._remove = weakref.finalize(self, os.remove, path)

    def apply(self, pool, ops: list[tuple[str, int, int]]) -> None:
        """Run one step's tier operations in order: ("offload" | "swap_out", block, slot) write a block out,
        ("load" | "swap_in", slot, block) read one back (a swap moves the same bytes; only the block manager's
        bookkeeping differs)."""
        for op, a, b in ops:
            if op in ("offload", "swap_out"):
                self.offload(pool, a, b)
            else:
                self.load(pool, a, b)

    def offload(self, pool, block_id: int, slot: int) -> None:
        data = read_block(pool, block_id)  # now, before this step overwrites the block
        with self.done:
            self.pending[slot] = self.pending.get(slot, 0) + 1
        self.stats.offloads += 1
        self.queue.put((slot, data))

    def load(self, pool, slot: int, block_id: int) -> None:
        start = time.perf_counter()
        with self.done:
            if self.pending.get(slot):
                self.stats.stalls += 1
                self.done.wait_for(lambda: not self.pending.get(slot))
                self.stats.stall_seconds += time.perf_counter() - start
            self._raise_writer_error()
        start = time.perf_counter()  # the tier's own read: waiting for our writer is not its bandwidth
        write_block(pool, block_id, self.slots[slot])
        self.stats.loads += 1
        self.stats.bytes_read += self.block_nbytes
        self.stats.load_seconds += time.perf_counter() - start

    def _write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            slot, data = item
            written = 0
            try:
                self.slots[slot].copy_(data)
                written = self.block_nbytes
            except Exception as e:  # recorded, and the write still counts as done: nobody waits for it forever
                self.error = self.error or e
            with self.done:
                self.stats.bytes_written += written
                self.pending[slot] -= 1
                if not self.pending[slot]:
                    del self.pending[slot]
                self.done.notify_all()

    def flush(self) -> None:
        """Wait until every queued write is in the file."""
        with self.done:
            self.done.wait_for(lambda: not self.pending)
            self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        """A failed write fails the step that needs the file (a load) or waits for it (flush), not a later hang."""
        if self.error is not None:
            raise RuntimeError(f"the KV tier's writer failed on {self.path}: {self.error!r}") from self.error

    def close(self) -> None:
        """Finish the queued writes, stop the writer, remove the file."""
        if not self.writer.is_alive():
            return
        self.queue.put(None)
        self.writer.join()
        del self.slots
        self._remove()
