"""Chapter 18 — the second tier's index: which file slot holds which evicted prefix block.

The pool (chapter 05) is the first tier. When it evicts a cached block (the allocator hands it out for new
contents), its K/V go to the second tier instead of being lost: a file of `capacity` slots, one block each
(file_tier.py moves the bytes). This index is the integer half, kept by the block manager: block hash ->
slot, the same (hash, parent hash, tokens) check as the prefix cache (prefix_cache.py), and LRU eviction
when every slot is taken.

Worked example, capacity 2:

    t = TierIndex(2)
    t.store(h1, p1, toks1) -> 0          slot 0 written: free slots [1]
    t.store(h2, p2, toks2) -> 1          slot 1 written: free slots []
    t.store(h1, p1, toks1) -> None       already there: nothing to write (it counts as used: LRU order h2, h1)
    t.lookup(h2, p2, toks2) -> 1         found (lookup alone changes nothing)
    t.mark_used(1)                       a load read it: LRU order h1, h2
    t.store(h3, p3, toks3) -> 0          full: h1, the least recently used, is dropped; its slot 0 is reused

Swap (the preemption mode "swap", chapter 18) pins slots instead: a preempted sequence's blocks are written to
slots that no LRU eviction may take until the sequence is swapped back in (or aborted). Going on from above:

    t.pin(1) -> [1]                      no slot free: h2, the least recently used, is dropped; slot 1 pinned
    t.store(h4, p4, toks4) -> 0          full: h3 is dropped, never the pinned slot
    t.pin(2) -> None                     1 slot free or held by an entry: nothing changes (the caller recomputes)
    t.unpin([1])                         swapped back in: slot 1 is free again

Slots are only ever handed out by `store` and `pin`; every slot is free, holds exactly one entry, or is pinned:
len(t) + t.num_free_slots + t.num_pinned == capacity at all times.
"""

from collections import OrderedDict
from collections.abc import Sequence


class TierIndex:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a tier needs at least 1 slot, got {capacity}")
        self.capacity = capacity
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: 0 first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self.entries: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # slot -> (hash, parent, tokens)
        self.num_evicted = 0  # entries dropped to make room (their blocks are gone from both tiers)
        self.pinned: set[int] = set()  # slots holding a swapped-out sequence's blocks: outside the LRU

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_pinned(self) -> int:
        return len(self.pinned)

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """The slot holding this block, or None (absent, or another block under the hash). No side effects."""
        slot = self.slot_of.get(block_hash)
        if slot is None:
            return None
        _, parent, tokens = self.entries[slot]
        return slot if parent == parent_hash and tokens == tuple(token_ids) else None

    def mark_used(self, slot: int) -> None:
        """A load read `slot`: it becomes the most recently used."""
        self.slot_of.move_to_end(self.entries[slot][0])

    def store(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """Make room for an evicted block: the slot to write its K/V to, or None when the tier already holds
        this hash (then it only becomes the most recently used) or every slot is pinned (then the block is lost,
        as without a tier). Full: the least recently used entry goes."""
        if block_hash in self.slot_of:
            self.slot_of.move_to_end(block_hash)
            return None
        if not self.free_slots and not self.slot_of:
            return None
        slot = self._take_slot()
        self.slot_of[block_hash] = slot
        self.entries[slot] = (block_hash, parent_hash, tuple(token_ids))
        return slot

    def _take_slot(self) -> int:
        """A free slot, or the least recently used entry's (the entry is dropped). Pinned slots are never taken."""
        if self.free_slots:
            return self.free_slots.pop()
        _, slot = self.slot_of.popitem(last=False)
        del self.entries[slot]
        self.num_evicted += 1
        return slot

    def pin(self, n: int) -> list[int] | None:
        """`n` slots for a swap-out, held outside the LRU until unpin: free slots first, then the least recently
        used entries' (dropped). None, changing nothing, when fewer than n slots are free or held by an entry."""
        if n > self.num_free_slots + len(self.entries):
            return None
        slots = [self._take_slot() for _ in range(n)]
        self.pinned.update(slots)
        return slots

    def unpin(self, slots: list[int]) -> None:
        """The swapped-out blocks were read back (or their sequence aborted): the slots are free again."""
        for slot in slots:
            self.pinned.remove(slot)
            self.free_slots.append(slot)
