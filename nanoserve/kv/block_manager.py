"""Chapter 05 — the block manager: one block table per sequence, and the prefix cache.

A sequence's keys and values live in blocks scattered over the pool; its *block table* lists
them in order, so token position p lives in

    block  block_table[p // block_size],  offset  p % block_size
    slot = block_table[p // block_size] * block_size + p % block_size     (a row of the flat pool)

Worked example, block_size 4, a 6-token prompt then 3 decode steps, free list [0, 1, 2, ...]:

    allocate_slots(7, prompt, 6)       block table [0, 1]       positions [0, 6) -> slots 0 1 2 3 4 5
    allocate_slots(7, prompt + [a], 7) block table [0, 1]       position 6 -> slot 6
    allocate_slots(7, ... + [b], 8)    block table [0, 1]       position 7 -> slot 7
    allocate_slots(7, ... + [c], 9)    block table [0, 1, 2]    position 8 -> slot 8 (a new block)

A sequence wastes at most block_size - 1 slots (its last block's tail), instead of everything
between its length and the maximum length a contiguous cache must reserve (chapter 04).

Prefix caching: every full block whose tokens are known is registered under its chain hash
(prefix_cache.py). A new sequence whose leading full blocks are found shares them (ref count +1)
instead of computing them again. When the last holder frees a cached block it goes to the free
list but keeps its contents and its hash: it is reused by the next hit or evicted (LRU) when the
allocator hands it out for something else.

Whose prefix: token ids that carry a `cache_salt` (SaltedTokenIds, a Sequence's when its request has one)
start their chain at root_hash(salt) instead of None, so only requests with the same salt hit each other's
blocks (chapter 08: with --api-keys every tenant has its own salt).

The manager deals in integers only; the tensors live in paged_attention.PagedKVCache.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from nanoserve.kv.block_allocator import BlockAllocator
from nanoserve.kv.prefix_cache import PrefixCache, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of positions [start, end): where those tokens' K/V are written.

    >>> slot_mapping([5, 2], 2, 7, block_size=4)   # positions 2, 3 in block 5; 4, 5, 6 in block 2
    [22, 23, 8, 9, 10]
    """
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end} need {cdiv(end, block_size)} blocks, the table has {len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens of new sequences
    hit_tokens: int = 0  # of those, tokens found in the cache (never computed)
    hit_blocks: int = 0  # blocks shared instead of allocated: the blocks saved
    evicted_blocks: int = 0  # cached blocks handed out again for new contents

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    _lookups_off = False  # inside prefix_lookups_off()

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        allocator: BlockAllocator | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        """`allocator` / `prefix_cache` let the learner's exercise code (exercises/05-paged-kv/) run the
        real thing: BlockManager(n, allocator=implementation("nanoserve.kv.block_allocator").BlockAllocator(n))."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = allocator if allocator is not None else BlockAllocator(num_blocks)
        if self.allocator.get_num_free_blocks() != num_blocks:
            raise ValueError(f"the allocator has {self.allocator.get_num_free_blocks()} free blocks, expected {num_blocks}")
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.stats = PrefixCacheStats()
        self.block_tables: dict[int, list[int]] = {}
        self.block_hashes: dict[int, list[int]] = {}  # chain hashes of each sequence's registered full blocks
        self.num_slots: dict[int, int] = {}  # positions each sequence's table has been asked to cover so far
        # (src, dst) block copies the model runner must do before the next step (copy-on-write after fork)
        self.pending_copies: list[tuple[int, int]] = []
        # told of every change to the prefix cache, in order (chapter 16's KV events): objects with
        # block_stored(block_hash, parent_hash, token_ids, lora) and block_removed(block_hash); lora: the
        # (lora_id, lora_name) the sequence's tokens carry (chapter 19), None for the base model's blocks
        self.kv_listeners: list = []

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones, including cached blocks no one uses (evictable)."""
        return self.allocator.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Share of the pool held by running sequences (0..1)."""
        return 1 - self.get_num_free_blocks() / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (the manager's own list: read it, do not change it)."""
        return self.block_tables[seq_id]

    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens the prefix cache already holds (full blocks only); no side effects.

        Never the whole prompt: the last token must be computed, its logits pick the next token.
        """
        return len(self._cached_prefix(token_ids)[0]) * self.block_size

    @contextmanager
    def prefix_lookups_off(self):
        """Within it lookups find nothing, so a new sequence computes every position itself; its full blocks
        are still registered. Chapter 08: a request that wants its prompt logprobs needs the logits of every
        prompt position, which a prefix hit would skip (vLLM does the same)."""
        self._lookups_off = True
        try:
            yield
        finally:
            self._lookups_off = False

    def _cached_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(block ids, chain hashes) of the longest cached run of leading full blocks."""
        if not self.enable_prefix_caching or self._lookups_off:
            return [], []
        blocks, hashes = [], []
        parent = root_hash(getattr(token_ids, "cache_salt", None))  # None unless the tokens carry a salt
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = self.prefix_cache.hash_block(parent, tokens)
            block_id = self.prefix_cache.get(h, parent, tokens)
            if block_id is None:
                break
            blocks.append(block_id)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        """Grow `seq_id`'s block table to cover positions [0, num_tokens); None (changing nothing) if the
        free blocks do not suffice.

        On the first call the cached leading blocks are shared (see lookup_prefix). Full blocks among the
        first num_tokens whose tokens are known are registered in the prefix cache.
        """
        table = self.block_tables.get(seq_id)
        if table is None:
            hit_blocks, hit_hashes = self._cached_prefix(token_ids)
            table, covered = [], 0
        else:
            hit_blocks, hit_hashes = [], []
            covered = self.num_slots[seq_id]

        num_new = max(cdiv(num_tokens, self.block_size) - len(table) - len(hit_blocks), 0)
        # After a fork two sequences share their partial last block: the first one to write a new
        # token into it gets its own copy (copy-on-write), or it would overwrite its sibling's token.
        cow = (num_tokens > covered and covered % self.block_size != 0
               and self.allocator.ref_count(table[covered // self.block_size]) > 1)
        # Reviving a cached block that no one holds takes it off the free list too.
        num_revived = sum(self.allocator.ref_count(b) == 0 for b in hit_blocks)
        if not self.allocator.can_allocate(num_new + cow + num_revived):
            return None

        if hit_blocks:
            for block_id in hit_blocks:  # pin the hits before anything is evicted for the new blocks
                self.allocator.incref(block_id)
            table.extend(hit_blocks)
            self.stats.hit_blocks += len(hit_blocks)
        new_blocks = self.allocator.allocate(num_new + cow)
        for block_id in new_blocks:
            # The block gets new contents: the cache must forget what it held.
            self._evict(block_id)
        if cow:
            shared = table[covered // self.block_size]
            table[covered // self.block_size] = new_blocks.pop()
            self.allocator.free(shared)
            self.pending_copies.append((shared, table[covered // self.block_size]))
        table.extend(new_blocks)

        if seq_id not in self.block_tables:
            self.block_tables[seq_id] = table
            self.block_hashes[seq_id] = hit_hashes
            self.stats.queried_tokens += len(token_ids)
            self.stats.hit_tokens += len(hit_blocks) * self.block_size
        self.num_slots[seq_id] = max(covered, num_tokens, len(hit_blocks) * self.block_size)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq_id, token_ids, num_tokens)
        return table

    def _register_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> None:
        table, hashes = self.block_tables[seq_id], self.block_hashes[seq_id]
        bs = self.block_size
        for i in range(len(hashes), min(num_tokens, len(token_ids)) // bs):
            parent = hashes[-1] if hashes else root_hash(getattr(token_ids, "cache_salt", None))
            tokens = token_ids[i * bs:(i + 1) * bs]
            hashes.append(self.prefix_cache.hash_block(parent, tokens))
            # Cached only under a parent that the cache holds as this table's block i - 1. If another block
            # holds the parent's hash (a collision), a lookup would match that block and then this one, whose
            # K/V were computed after other tokens.
            if i == 0 or self.prefix_cache.entries.get(table[i - 1], (None,))[0] == parent:
                self._cache(hashes[-1], parent, tokens, table[i], getattr(token_ids, "lora", None))

    def _cache(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], block_id: int,
               lora: tuple[int, str] | None = None) -> None:
        """Register a full block in the prefix cache and, if the cache took it, tell the listeners (and under
        which adapter its K/V were computed: `lora`, (lora_id, lora_name), None for the base model)."""
        if self.prefix_cache.insert(block_hash, parent_hash, token_ids, block_id):
            for listener in self.kv_listeners:
                listener.block_stored(block_hash, parent_hash, token_ids, lora)

    def _evict(self, block_id: int) -> None:
        """Drop the block from the prefix cache, if it held it, and tell the listeners which hash left."""
        entry = self.prefix_cache.entries.get(block_id)  # (hash, parent, tokens) or None
        if self.prefix_cache.evict(block_id):
            self.stats.evicted_blocks += 1
            for listener in self.kv_listeners:
                listener.block_removed(entry[0])

    def uncache(self, seq_id: int) -> None:
        """Drop `seq_id`'s blocks from the prefix cache: their K/V were never written (chapter 17's failed
        load), so no later prompt may hit them."""
        for block_id in self.block_tables.get(seq_id, []):
            self._evict(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's reset_prefix_cache): their K/V are about to be lost (chapter 19's
        sleep frees the pool). The listeners hear each block leave. Only an idle pool can be reset: a block a
        sequence holds must keep its contents. Returns the number of blocks forgotten."""
        if self.block_tables:
            raise RuntimeError(f"{len(self.block_tables)} sequence(s) still hold blocks: the prefix cache can only "
                               "be reset on an idle pool")
        cached = list(self.prefix_cache.entries)
        for block_id in cached:
            self._evict(block_id)
        return len(cached)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares all of the parent's blocks (ref count +1 each): no KV is copied until
        one of them writes into the shared partial last block (copy-on-write in allocate_slots)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"fork: sequence {child_seq_id} already has a block table")
        table = self.block_tables[parent_seq_id]
        for block_id in table:
            self.allocator.incref(block_id)
        self.block_tables[child_seq_id] = list(table)
        self.block_hashes[child_seq_id] = list(self.block_hashes[parent_seq_id])
        self.num_slots[child_seq_id] = self.num_slots[parent_seq_id]

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (a no-op for a sequence that holds none)."""
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            return
        del self.block_hashes[seq_id], self.num_slots[seq_id]
        # Last block first: it goes to the free list first and is evicted first, while the
        # leading blocks — the ones most likely shared by other prompts — stay cached longest.
        for block_id in reversed(table):
            self.allocator.free(block_id)

    def shrink(self, seq_id: int, num_blocks: int, num_slots: int) -> list[int]:
        """Keep the first `num_blocks` of `seq_id`'s table and give the rest back to the pool (last first, as
        free does); the table then covers at most `num_slots` positions. Chapter 14's rollback: the slots of
        rejected proposals. Refuses (RuntimeError) to drop a block registered in the prefix cache.

            block_size 4, table [3, 8, 5], shrink(seq, 2, 7) -> [5]; table [3, 8], 7 positions covered
        """
        table = self.block_tables[seq_id]
        if len(self.block_hashes[seq_id]) > num_blocks:
            raise RuntimeError(f"{seq_id!r}: block {num_blocks} onwards holds a prefix-cached block")
        freed = table[num_blocks:]
        del table[num_blocks:]
        for block_id in reversed(freed):
            self.allocator.free(block_id)
        self.num_slots[seq_id] = min(self.num_slots[seq_id], num_slots)
        return freed

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies to do before this step's attention (PagedKVCache.copy_blocks)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
