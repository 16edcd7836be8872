"""Chapter 16 — KV-cache events: what a fleet router learns when blocks enter or leave the prefix cache.

A prefix-aware router in front of many servers wants to know which server holds which prefix.
Guessing from where it sent requests goes stale as soon as a server evicts; vLLM therefore publishes
an event per change, and nanoserve records the same three kinds, named as vLLM names them:

    BlockStored(block_hashes=[h2], parent_block_hash=h1, token_ids=[16 ids], block_size=16,
                lora_id=3, lora_name="upper")      under an adapter (chapter 19); the base model's: None, None
    BlockRemoved(block_hashes=[h2])        the allocator handed the block out for new contents
    AllBlocksCleared()                     the cache was emptied (a restart)

They are recorded here, in kv/, as plain objects; sending them (msgpack over ZMQ, vLLM's wire format)
is the server's business (nanoserve/server/kv_events.py), so the KV code imports no network library.

    log = record_kv_events(engine.block_manager)    # listens to its prefix cache, before the first request
    ...                                             # requests run
    log.take()                                      # [BlockStored(...), BlockRemoved(...), ...], drained
"""

import threading
from dataclasses import dataclass, field

from nanoserve.kv.prefix_cache import hash_block


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # the adapter's id, new at each load (vLLM keeps it; lora_name is its successor)
    medium: str | None = "GPU"  # vLLM's name for "the device's KV pool"; here it is the CPU's
    lora_name: str | None = None  # the adapter whose K/V the block holds (chapter 19); None: the base model


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class KVEventLog:
    """Events in the order they happened; the engine thread appends (the block manager calls block_stored and
    block_removed as its prefix cache changes), a publisher thread takes."""
    block_size: int
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def append(self, event) -> None:
        with self.lock:
            self.events.append(event)

    def take(self) -> list:
        with self.lock:
            events, self.events = self.events, []
        return events

    def block_stored(self, block_hash: int, parent_hash: int | None, token_ids,
                     lora: tuple[int, str] | None = None) -> None:
        lora_id, lora_name = lora if lora is not None else (None, None)
        self.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, lora_id,
                                lora_name=lora_name))

    def block_removed(self, block_hash: int) -> None:
        self.append(BlockRemoved([block_hash]))


def record_kv_events(block_manager) -> KVEventLog:
    """Listen to the block manager's prefix cache (BlockManager.kv_listeners); returns the log. Call it before the
    first request: blocks cached earlier were never announced. The first event says so: AllBlocksCleared.
    Only what really changes the cache is an event: an insert the cache refused (hash already taken) and an
    eviction of a block that was not cached are not."""
    learner = [name for name in ("allocate_slots", "_register_full_blocks")
               if getattr(type(block_manager), name).__module__.startswith("student_")]
    if learner:  # exercise 5.4's code calls the prefix cache itself: its changes would reach no listener
        raise ValueError(f"KV events need the reference block manager: with --student 05, {', '.join(learner)} "
                         "change the prefix cache without telling BlockManager.kv_listeners; leave 05 out of --student")
    # The hashes go out as 32 bytes each (vLLM's wire format), and a router matches them against the chain it
    # computes from the prompt with the reference's hash_block: a learner's hash (exercise 5.2) that names blocks
    # otherwise would not fit the bytes or would never match. Probed here, before the first request.
    named = block_manager.prefix_cache.hash_block
    probes = [(None, [1, 2, 3]), (hash_block(None, [1, 2, 3]), [4, 5])]
    if any(named(parent, tokens) != hash_block(parent, tokens) for parent, tokens in probes):
        raise ValueError("KV events carry the reference's block hashes (SHA-256 of the parent's 32 bytes and the "
                         "int64 token ids), which routers recompute from prompts: with --student 05, your hash_block "
                         "(exercise 5.2) names blocks otherwise; leave 05 out of --student")
    log = KVEventLog(block_manager.block_size)
    log.append(AllBlocksCleared())
    block_manager.kv_listeners.append(log)
    return log
