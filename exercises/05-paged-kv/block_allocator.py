"""Exercise 5.1 — the block allocator: a free list and ref counts.

Your version of nanoserve/kv/block_allocator.py: same class, same methods. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=05`.

The pool has `num_blocks` blocks, ids 0 .. num_blocks - 1. A block with ref count 0 is free and sits
in the free list; a block with ref count n >= 1 is held by n block tables. Keep the free list as
`self.free_list`, iterable front to back (the tests read `list(a.free_list)`), in LRU order: `allocate`
takes from the FRONT (least recently freed first; at the start: 0, 1, 2, ...), `free` puts a block that
drops to 0 at the BACK. Its three operations — take the front, append at the back, remove from the
middle (`incref` of a free block) — should each cost O(1) whatever the pool's size. (A plain dict does
not pop its front in O(1): time `next(iter(d))` then `del` on 100,000 keys.) That cost is not graded — the
tests check behaviour only, and a list's `pop(0)` passes them — but the engine's pools hold thousands of blocks
and allocate in every step.

    a = BlockAllocator(4)          free list [0, 1, 2, 3]
    a.allocate(2) -> [0, 1]        free list [2, 3]
    a.allocate(3) -> None          only 2 free: says no, changes nothing
    a.incref(1)                    ref_count(1) == 2
    a.free(1); a.free(0)           ref_count(1) == 1; block 0 drops to 0: free list [2, 3, 0]
    a.allocate(3) -> [2, 3, 0]
"""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        """Exercise 5.1. Every block free, ref count 0, free list in id order.
        Raise ValueError (mentioning "num_blocks") if num_blocks < 1."""
        raise NotImplementedError("Exercise 5.1: set up the ref counts and the free list")

    def get_num_free_blocks(self) -> int:
        """Exercise 5.1. How many blocks are free (ref count 0)."""
        raise NotImplementedError("Exercise 5.1: count the free blocks")

    def can_allocate(self, num_blocks: int) -> bool:
        """Exercise 5.1. Whether `allocate(num_blocks)` would succeed."""
        raise NotImplementedError("Exercise 5.1: compare with the free list")

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Exercise 5.1. Take `num_blocks` blocks from the front of the free list, each with ref count 1.
        Return None — changing nothing — if fewer are free. Raise ValueError if num_blocks < 0."""
        raise NotImplementedError("Exercise 5.1: pop blocks from the front of the free list")

    def incref(self, block_id: int) -> None:
        """Exercise 5.1. One more block table holds `block_id` (a fork, or a prefix-cache hit).
        A free block (ref count 0) leaves the free list: it is in use again, with its old contents."""
        raise NotImplementedError("Exercise 5.1: count one more holder (revive a free block)")

    def free(self, block_id: int) -> None:
        """Exercise 5.1. One holder fewer; at ref count 0 the block goes to the BACK of the free list.
        Raise ValueError (mentioning "double free") for a block that is already free, and ValueError
        for an id outside the pool (as incref and ref_count do)."""
        raise NotImplementedError("Exercise 5.1: count one holder fewer (free at zero)")

    def ref_count(self, block_id: int) -> int:
        """Exercise 5.1. How many block tables hold `block_id`."""
        raise NotImplementedError("Exercise 5.1: return the ref count")
