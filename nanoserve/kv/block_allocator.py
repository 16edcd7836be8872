"""Chapter 05 — the block allocator: a pool of fixed-size KV blocks, a free list and ref counts.

The KV pool is cut into `num_blocks` blocks of `block_size` token slots each. The allocator
knows nothing about tokens or tensors: it hands out block ids and counts how many block tables
hold each one.

    ref_count[b] == 0   b is free: it sits in the free list and may be handed out
    ref_count[b] >= 1   b is in use by that many block tables (shared by fork or by a prefix hit)

The free list is kept in LRU order: `allocate` takes blocks from the front (the least recently
freed), `free` puts a block that drops to 0 at the back. A freed block keeps its contents until
it is handed out again, which is what lets the prefix cache (prefix_cache.py) revive it with
`incref` — evicting the least recently used cached block first.

Worked example (4 blocks):

    a = BlockAllocator(4)          free list [0, 1, 2, 3]
    a.allocate(2) -> [0, 1]        free list [2, 3]
    a.allocate(3) -> None          only 2 free: says no, changes nothing
    a.incref(1)                    ref_count(1) == 2: two tables share block 1
    a.free(1); a.free(0)           ref_count(1) == 1; block 0 drops to 0: free list [2, 3, 0]
    a.allocate(3) -> [2, 3, 0]     free list []
"""

from collections import OrderedDict


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # An OrderedDict used as an ordered set: O(1) pop from the front, append at the back, and removal
        # from the middle (when `incref` revives a cached block). A plain dict pops its front in O(n): its
        # deleted entries stay at the front of its table until it is rebuilt, and `next(iter(d))` walks them.
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_list)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_list)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks from the front of the free list, each with ref count 1.

        Returns None — and changes nothing — when fewer are free: running out is not an error,
        the scheduler decides what to do (wait, or preempt someone).
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {num_blocks}")
        if not self.can_allocate(num_blocks):
            return None
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self.free_list.popitem(last=False)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def incref(self, block_id: int) -> None:
        """One more block table holds `block_id` (fork, or a prefix-cache hit).

        A free block (ref count 0) leaves the free list: its contents are still valid and now in use again.
        """
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            del self.free_list[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """One block table fewer holds `block_id`; at ref count 0 it goes to the back of the free list."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_list[block_id] = None

    def ref_count(self, block_id: int) -> int:
        self._check(block_id)
        return self.ref_counts[block_id]

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool of {self.num_blocks} blocks")
