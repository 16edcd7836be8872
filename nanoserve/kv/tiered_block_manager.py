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


class TieredBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, tier, bytes_per_token: float,
                 rates: MeasuredRates | None = None, load_policy=None, allocator=None):
        """tier: a TierIndex (or the learner's, exercise 18.1); bytes_per_token: what loading a token reads;
        rates: the engine's measurements; load_policy: the module with should_load (exercise 18.2)."""
        self.tier_ops: list[tuple[str, int, int]] = []
        self.tier_stats = TierStats()
        super().__init__(num_blocks, block_size, True, allocator=allocator,
                         prefix_cache=OffloadingPrefixCache(tier, self.tier_ops, self.tier_stats))
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
        # At most half the tier: the offloads that make room for the run in the pool must find slots outside it
        # (the run is marked most recently used first, so LRU takes the others), or one would overwrite a slot
        # before it is read.
        run = run[:self.tier.capacity // 2]
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

    def take_tier_ops(self) -> list[tuple[str, int, int]]:
        """The step's tier operations, in order, for the worker (FileKVTier.apply)."""
        ops, self.tier_ops[:] = list(self.tier_ops), []
        return ops
