"""Exercise 18.1 — the second tier's slot bookkeeping (mirrors nanoserve/kv/tier_index.py).

When the pool evicts a cached prefix block, its K/V go to a file of `capacity` slots. This class is the
integer half: block hash -> slot, with the prefix cache's (hash, parent hash, tokens) check, and LRU eviction
when every slot is taken. The block manager calls it; the worker moves the bytes.
"""

from collections.abc import Sequence


class TierIndex:
    def __init__(self, capacity: int):
        """Exercise 18.1. An empty tier of `capacity` slots (ValueError if capacity < 1).

        The block manager and the stats read two attributes: `capacity` (int) and `num_evicted` (int: entries
        dropped to make room so far). How you keep the free slots, the hash -> slot map and its LRU order is
        yours; the tests see them only through len(), num_free_slots, lookup, mark_used and store.
        Free slots are handed out lowest first: 0, then 1, 2, ...
        Invariant, always: len(self) + self.num_free_slots == capacity.
        """
        raise NotImplementedError("Exercise 18.1: TierIndex.__init__")

    def __len__(self) -> int:
        """Exercise 18.1. The number of slots that hold an entry."""
        raise NotImplementedError("Exercise 18.1: TierIndex.__len__")

    @property
    def num_free_slots(self) -> int:
        """Exercise 18.1. The number of slots no entry holds."""
        raise NotImplementedError("Exercise 18.1: TierIndex.num_free_slots")

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """Exercise 18.1. The slot holding this block, or None: absent, or the slot's entry has another parent
        or other tokens (a collision). Changes nothing (not even the LRU order).

        >>> t = TierIndex(2); t.store(7, None, [1, 2]); t.lookup(7, None, [1, 2]), t.lookup(7, None, [1, 3])
        (0, None)
        """
        raise NotImplementedError("Exercise 18.1: TierIndex.lookup")

    def mark_used(self, slot: int) -> None:
        """Exercise 18.1. A load read `slot` (it holds an entry): that entry becomes the most recently used."""
        raise NotImplementedError("Exercise 18.1: TierIndex.mark_used")

    def store(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """Exercise 18.1. Make room for an evicted block; return the slot its bytes will be written to.

        - hash already held: it becomes the most recently used; return None (nothing to write);
        - else the next free slot; with none free, the least recently used entry is dropped (num_evicted + 1)
          and its slot reused. The new entry is the most recently used.

        Capacity 2: store(h1) -> 0, store(h2) -> 1, store(h1) -> None (order h2, h1), store(h3) -> 1 (h2 dropped).
        """
        raise NotImplementedError("Exercise 18.1: TierIndex.store")
