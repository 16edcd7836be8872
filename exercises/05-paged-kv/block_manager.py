"""Exercises 5.3 (slot_mapping) and 5.4 (BlockManager.allocate_slots) — the block manager's integers.

Your version of nanoserve/kv/block_manager.py. Everything else is given: your BlockManager inherits
the reference's constructor, lookup_prefix / _cached_prefix, fork, free, shrink and take_copies, so you write
the two rungs only. Grade one with `make grade CH=05 EX=5.3` (or EX=5.4); README.md has the design
questions to answer first.

What you have in a BlockManager (see nanoserve/kv/block_manager.py for their code):

    self.block_size, self.enable_prefix_caching
    self.allocator          exercise 5.1's BlockAllocator: can_allocate, allocate, incref, free, ref_count
    self.prefix_cache       exercise 5.2's PrefixCache: hash_block(parent, tokens), get, insert, evict
    self.stats              PrefixCacheStats: queried_tokens, hit_tokens, hit_blocks, evicted_blocks
    self.block_tables       seq_id -> list of block ids (the block table)
    self.block_hashes       seq_id -> chain hashes of its registered full blocks, in order
    self.num_slots          seq_id -> how many positions its table has been asked to cover so far
    self.pending_copies     (src, dst) block copies for the model runner (copy-on-write)
    self._cached_prefix(token_ids) -> (block ids, chain hashes) of the cached leading full blocks
"""

from collections.abc import Sequence

from nanoserve.kv.block_manager import BlockManager as ReferenceBlockManager
from nanoserve.kv.block_manager import PrefixCacheStats, cdiv  # noqa: F401  (given: cdiv(a, b) is ceil(a / b))
from nanoserve.kv.prefix_cache import root_hash  # noqa: F401  (given: where a chain of block hashes starts, a salt or None)


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Exercise 5.3. The pool slots of positions [start, end): where those tokens' K/V are written.

    Position p lives in block block_table[p // block_size] at offset p % block_size; its slot (a row of the
    flat pool) is block · block_size + offset. Raise ValueError (mentioning "blocks") if the table has too
    few blocks for position end - 1.

    >>> slot_mapping([5, 2], 2, 7, block_size=4)   # positions 2, 3 in block 5; 4, 5, 6 in block 2
    [22, 23, 8, 9, 10]
    """
    raise NotImplementedError("Exercise 5.3: map positions to pool slots through the block table")


class BlockManager(ReferenceBlockManager):
    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        """Exercise 5.4. Grow `seq_id`'s block table to cover positions [0, num_tokens) and return it; return
        None — changing nothing at all — if the free blocks do not suffice.

        What must hold afterwards (the tests of 5.4 check each):
          - all or nothing: when the free blocks cannot cover everything this call needs — new blocks, a
            block for copy-on-write, and the cached blocks it revives — it returns None and no table, ref
            count, free list, stat or cache entry has changed;
          - a new sequence (no table yet) starts from its cached prefix (`self._cached_prefix(token_ids)`):
            it shares those blocks (their ref counts go up) and its table starts with them; a cached block
            that no one held is taken off the free list, and is never also handed out as a "new" block;
          - a newly allocated block holds no cached contents any more (the prefix cache forgets it; the
            evictions are counted in stats.evicted_blocks);
          - copy-on-write: this call never writes into a block another table still holds (ref count > 1
            after a fork); such a partially filled last block is swapped in this table for a fresh one, this
            table's hold on the shared one is released, and (shared, fresh) waits in self.pending_copies;
          - the bookkeeping: self.block_tables, self.block_hashes (the hit chain) and self.num_slots for the
            sequence; stats.queried_tokens, hit_tokens and hit_blocks counted once per new sequence; with
            prefix caching on, every full block is registered (_register_full_blocks).

            m = BlockManager(num_blocks=8, block_size=4)
            m.allocate_slots(1, list(range(10)), 10)  -> [0, 1, 2]   blocks 0 and 1 full: registered
            m.allocate_slots(2, list(range(10)), 10)  -> [0, 1, 3]   0 and 1 shared (ref count 2), 3 is new
        """
        raise NotImplementedError("Exercise 5.4: grow the block table (prefix hits, new blocks, copy-on-write)")

    def _register_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> None:
        """Exercise 5.4. Register the full blocks of `seq_id` among its first num_tokens positions whose tokens
        are known (min(num_tokens, len(token_ids)) // block_size blocks) that were not handled yet
        (self.block_hashes[seq_id] holds the chain hashes handled so far, one per block).

        What must hold afterwards:
          - block_hashes[seq_id] has the chain hash of every such full block: hash_block(the previous block's
            hash, its tokens), where block 0's "previous hash" is the chain's root, root_hash(the tokens'
            cache_salt) — token ids may be a SaltedTokenIds, a list with a `cache_salt` attribute (None or absent:
            root_hash(None) is None), so that requests with different salts never share a block (the lookup you
            inherit, _cached_prefix, starts its chain at the same root); a partially filled block gets none;
          - block i is in the prefix cache under its hash, with its parent hash and tokens — unless the hash is
            taken (insert says no), or the cache does not hold this table's block i - 1 under the parent hash
            (a collision gave that hash to another block: a lookup matching that block would then walk into
            block i, whose K/V were computed after other tokens).

            m = BlockManager(num_blocks=8, block_size=4)        # allocate_slots calls it
            m.allocate_slots(1, list(range(10)), 10)
            h0 = hash_block(None, (0, 1, 2, 3));  h1 = hash_block(h0, (4, 5, 6, 7))
            m.block_hashes[1] == [h0, h1]
            m.prefix_cache.entries == {0: (h0, None, (0, 1, 2, 3)), 1: (h1, h0, (4, 5, 6, 7))}
        """
        raise NotImplementedError("Exercise 5.4: register the full blocks under their chain hashes")
