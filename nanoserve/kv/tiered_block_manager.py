"""Chapter 18 — the block manager with a second tier: evicted prefix blocks are offloaded, found and loaded back.

Chapter 05's manager forgets a cached block when the allocator hands it out for new contents. Here:

  eviction   the block's (hash, parent, tokens) go to the TierIndex, which names a file slot for it, and
             ("offload", block, slot) is queued for the worker: its K/V are copied out before the step writes
  lookup     a new sequence's chain of full blocks is looked up in the pool first, then — from where the
             pool's run ends — in the tier; the tier's run is taken if loading it is measured to be cheaper
             than recomputing it (load_policy.should_load), else recomputed as if it were not there
  load       each tier hit gets a free block, registered in the prefix cache under its hash, and
             ("load", slot, block) is queued: the worker reads the bytes in before the step's forward pass,
             so the sequence's prefill goes on from the end of the loaded run

Worked example, block_size 4, a pool of 3 blocks, a tier of 8 slots (tests/test_ch18_tier.py runs it):
    A = 12 tokens: blocks a0 a1 a2 in pool blocks 0 1 2          pool [a0 a1 a2]
    A finishes; B (12 other tokens) is handed blocks 2 1 0 (last freed first, chapter 05): a2 a1 a0 are
    evicted, each offloaded to a slot                            ops [(offload 2 0) (offload 1 1) (offload 0 2)]
    B finishes; A returns: lookup_prefix(A) = 8. The pool has none of A's blocks, the tier all three, but only
    2 full blocks are taken (the last token is always computed, so a2 is too). Each load gets a free block,
    whose B contents are offloaded first:
        ops [(offload 0 3) (load 2 0) (offload 1 4) (load 1 1) (offload 2 5)]     A's table [0 1 2], computes 4

Swap (SchedulerConfig.preemption_mode "swap", vLLM v0's swap mode): when the scheduler preempts a sequence,
`swap_out` writes *all* its blocks, the partly filled last one too, to pinned tier slots (TierIndex.pin: no LRU
takes them) and frees them in the pool; the sequence keeps its computed tokens. `swap_in` later takes free blocks
for all of them at once, queues the reads and unpins the slots, and the sequence goes on where it stopped.
Worked example, block_size 4, a pool of 5 blocks, prefix caching off, a tier of 8 slots:

    A = 8 tokens: blocks [0 1]; B = 6 tokens: blocks [2 3]                       free [4]
    swap_out(B): slots 0 1 pinned        ops [(swap_out 2 0) (swap_out 3 1)]    free [4 3 2] (last block first)
    C = 8 tokens: blocks [4 3]                                                   free [2]
    swap_in(B, 7 tokens): 2 blocks wanted, 1 free -> None, nothing changes
    A finishes                                                                   free [2 1 0]
    swap_in(B, 7 tokens): blocks [2 1]   ops [(swap_in 0 2) (swap_in 1 1)]      slots 0 1 free again
    B's K/V (its 2-token last block too) are in blocks 2 and 1; position 6 is computed next, nothing recomputed

The swap operations go in the same ordered list as the offloads and loads (vLLM keeps blocks_to_swap_out and
blocks_to_swap_in apart; SchedulerOutput.blocks_to_swap_out / _in are those views of it): a slot freed by a
swap-in may be taken by an offload later in the same step, and its read must come first.

Everything here is integers; the tensors move in the worker (file_tier.FileKVTier.apply), in queue order — an
offload of a block must read it before a later load in the same step writes into it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.kv.block_manager import BlockManager, cdiv
from nanoserve.kv.load_policy import should_load
from nanoserve.kv.rates import MeasuredRates
from nanoserve.kv.prefix_cache import PrefixCache, root_hash


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens loaded from the tier instead of computed
    recomputed_tokens: int = 0  # tokens the tier held that were computed anyway (load_policy said recompute)
    offloaded_blocks: int = 0  # evicted blocks sent to the tier
    loaded_blocks: int = 0
    swapped_out_blocks: int = 0  # preempted sequences' blocks written to pinned slots (swap mode)
    swap_ins: int = 0  # swapped-out sequences brought back
    swap_fallbacks: int = 0  # preemptions the tier had no room for: recomputed instead


class OffloadingPrefixCache(PrefixCache):
    """Chapter 05's prefix cache, whose evictions go to the tier instead of being lost."""

    def __init__(self, tier, ops: list, stats: TierStats):
        super().__init__()
        self.tier, self.ops, self.tier_stats = tier, ops, stats

    def evict(self, block_id: int) -> bool:
        entry = self.entries.get(block_id)
        if entry is not None:
            slot = self.tier.store(*entry)
            if slot is not None:
                self.ops.append(("offload", block_id, slot))
                self.tier_stats.offloaded_blocks += 1
        return super().evict(block_id)


@dataclass
class Swapped:
    """A swapped-out sequence: the pinned slots holding its blocks, in block-table order, and the positions its
    table covered."""

    slots: list[int]
    num_slots: int


class TieredBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, tier, bytes_per_token: float,
                 rates: MeasuredRates | None = None, load_policy=None, allocator=None,
                 enable_prefix_caching: bool = True):
        """tier: a TierIndex (or the learner's, exercise 18.1); bytes_per_token: what loading a token reads;
        rates: the engine's measurements; load_policy: the module with should_load (exercise 18.2).
        enable_prefix_caching False: nothing is cached, so nothing is offloaded or looked up; the tier then holds
        only swapped-out sequences (swap mode)."""
        self.tier_ops: list[tuple[str, int, int]] = []
        self.tier_stats = TierStats()
        super().__init__(num_blocks, block_size, enable_prefix_caching, allocator=allocator,
                         prefix_cache=OffloadingPrefixCache(tier, self.tier_ops, self.tier_stats))
        self.swapped: dict[int | str, Swapped] = {}  # seq id -> its blocks in the tier
        self.tier, self.bytes_per_token = tier, bytes_per_token
        self.rates = rates if rates is not None else MeasuredRates()
        self.should_load = should_load if load_policy is None else load_policy.should_load

    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """Leading tokens found in the pool, then in the tier where loading them pays; no side effects."""
        blocks, hashes = self._cached_prefix(token_ids)
        return (len(blocks) + len(self._tier_run(token_ids, hashes, count=False))) * self.block_size

    def _tier_run(self, token_ids: Sequence[int], pool_hashes: list[int], count: bool) -> list[tuple]:
        """[(slot, hash, parent, tokens)] of the full blocks the tier holds right after the pool's run —
        [] if none, or if recomputing them is cheaper (counted in tier_stats when `count`)."""
        if not self.enable_prefix_caching or self._lookups_off:
            return []
        bs, run = self.block_size, []
        parent = pool_hashes[-1] if pool_hashes else root_hash(getattr(token_ids, "cache_salt", None))
        for i in range(len(pool_hashes), max(len(token_ids) - 1, 0) // bs):
            tokens = token_ids[i * bs:(i + 1) * bs]
            h = self.prefix_cache.hash_block(parent, tokens)
            slot = self.tier.lookup(h, parent, tokens)
            if slot is None:
                break
            run.append((slot, h, parent, tokens))
            parent = h
        # At most half the slots not pinned by a swap: the offloads that make room for the run in the pool must
        # find slots outside it (the run is marked most recently used first, so LRU takes the others), or one
        # would overwrite a slot before it is read.
        run = run[:(len(self.tier) + self.tier.num_free_slots) // 2]
        n = len(run) * bs
        if run and not self.should_load(n, self.bytes_per_token, self.rates.prefill_s_per_token(),
                                        self.rates.tier_bytes_per_s(), self.rates.load_latency_s()):
            if count:
                self.tier_stats.recomputed_tokens += n
            return []
        return run

    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        if seq_id not in self.block_tables and not self._promote(token_ids, num_tokens):
            return None
        return super().allocate_slots(seq_id, token_ids, num_tokens)

    def _promote(self, token_ids: Sequence[int], num_tokens: int) -> bool:
        """Bring the tier's run for a new sequence into the pool: free blocks, registered in the prefix cache,
        loads queued. Then chapter 05's allocate_slots finds them as cached blocks. False (nothing done) when
        the pool cannot hold the whole allocation."""
        pool_blocks, pool_hashes = self._cached_prefix(token_ids)
        run = self._tier_run(token_ids, pool_hashes, count=True)
        if not run:
            return True
        # the same count allocate_slots makes: new blocks (the tier's run among them) + cached ones revived
        revived = sum(self.allocator.ref_count(b) == 0 for b in pool_blocks)
        if not self.allocator.can_allocate(max(cdiv(num_tokens, self.block_size), len(pool_blocks) + len(run))
                                           - len(pool_blocks) + revived):
            return False
        for block_id in pool_blocks:  # pinned: allocating for the run must not evict them
            self.allocator.incref(block_id)
        for slot, *_ in run:
            self.tier.mark_used(slot)
        blocks = self.allocator.allocate(len(run))
        for block_id, (slot, h, parent, tokens) in zip(blocks, run):
            self._evict(block_id)  # queues its offload first; both tell the KV-event listeners (chapter 16)
            self._cache(h, parent, tokens, block_id, getattr(token_ids, "lora", None))
            self.tier_ops.append(("load", slot, block_id))
        self.tier_stats.hit_tokens += len(run) * self.block_size
        self.tier_stats.loaded_blocks += len(run)
        for block_id in pool_blocks + blocks:  # cached and free again, until allocate_slots takes them
            self.allocator.free(block_id)
        return True

    # ---- swap (preemption_mode "swap") -----------------------------------------------------------------------
    def swap_out(self, seq_id) -> bool:
        """Preempt by swap: every block of `seq_id`'s table to a pinned tier slot (("swap_out", block, slot)
        queued, in table order), then the blocks are freed. False, changing nothing, when the tier cannot pin
        that many slots (counted: the scheduler recomputes instead)."""
        table = self.block_tables[seq_id]
        slots = self.tier.pin(len(table))
        if slots is None:
            self.tier_stats.swap_fallbacks += 1
            return False
        self.tier_ops.extend(("swap_out", block_id, slot) for block_id, slot in zip(table, slots))
        self.swapped[seq_id] = Swapped(slots, self.num_slots[seq_id])
        self.tier_stats.swapped_out_blocks += len(table)
        super().free(seq_id)  # read by the worker before this step's forward pass writes into them
        return True

    def swap_in(self, seq_id, token_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        """Bring a swapped-out sequence back as one unit and grow its table to cover [0, num_tokens): a free
        block per pinned slot (("swap_in", slot, block) queued), then allocate_slots. None, changing nothing,
        when the pool cannot hold it all."""
        swapped = self.swapped[seq_id]
        if not self.allocator.can_allocate(max(cdiv(num_tokens, self.block_size), len(swapped.slots))):
            return None
        blocks = self.allocator.allocate(len(swapped.slots))
        for block_id, slot in zip(blocks, swapped.slots):
            self._evict(block_id)  # a cached block handed out: its offload is queued before the swap-in overwrites it
            self.tier_ops.append(("swap_in", slot, block_id))
        self.tier.unpin(swapped.slots)  # after their reads are queued: a later offload may take them
        del self.swapped[seq_id]
        # its full blocks are registered in the prefix cache again by allocate_slots (where their hashes are free)
        self.block_tables[seq_id], self.block_hashes[seq_id], self.num_slots[seq_id] = blocks, [], swapped.num_slots
        self.tier_stats.swap_ins += 1
        return self.allocate_slots(seq_id, token_ids, num_tokens)

    def free(self, seq_id) -> None:
        """Release the sequence's blocks; a swapped-out sequence's (aborted while it waits): its pinned slots."""
        swapped = self.swapped.pop(seq_id, None)
        if swapped is not None:
            self.tier.unpin(swapped.slots)
        super().free(seq_id)

    def take_tier_ops(self) -> list[tuple[str, int, int]]:
        """The step's tier operations, in order, for the worker (FileKVTier.apply)."""
        ops, self.tier_ops[:] = list(self.tier_ops), []
        return ops
