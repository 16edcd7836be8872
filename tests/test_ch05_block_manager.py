"""Chapter 05, exercise 5.4 (graded): the block manager's allocate_slots — hand-computed block tables
(prefix hits, pinning before allocating, registration of full blocks, copy-on-write after a fork), and a
hypothesis state machine that runs some sixty random sequences of up to forty allocate / grow / fork / free steps
each (STATE_MACHINE_SETTINGS) against invariants."""

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.kv.prefix_cache import PrefixCache
from nanoserve.student import implementation

pytestmark = pytest.mark.exercise("5.4")


@pytest.fixture
def BlockManager():
    return implementation("nanoserve.kv.block_manager").BlockManager


def slots(table, start, end, bs):
    """Positions [start, end) -> pool slots (the test's own slot mapping)."""
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def test_salted_chains_start_at_the_salts_root(BlockManager):
    """A request's cache_salt is its chain's root (vLLM's cache_salt): the same tokens under two salts share no
    block, under one salt they do, and an unsalted request finds neither salted prefix."""
    from nanoserve.kv.prefix_cache import SaltedTokenIds, hash_block, root_hash

    prompt = list(range(9))  # two full blocks of 4, then one token
    m = BlockManager(num_blocks=16, block_size=4)
    assert m.allocate_slots(1, SaltedTokenIds(prompt, "tenant:a"), 9) == [0, 1, 2]
    h0 = hash_block(root_hash("tenant:a"), (0, 1, 2, 3))
    assert m.block_hashes[1] == [h0, hash_block(h0, (4, 5, 6, 7))]
    assert m.allocate_slots(2, SaltedTokenIds(prompt, "tenant:b"), 9) == [3, 4, 5]  # another tenant: nothing shared
    assert m.allocate_slots(3, list(prompt), 9) == [6, 7, 8]  # no salt: neither tenant's prefix
    assert m.allocate_slots(4, SaltedTokenIds(prompt, "tenant:a"), 9) == [0, 1, 9]  # the same salt: both blocks hit
    assert m.stats.hit_tokens == 8


def test_prefill_then_decode_worked_example(BlockManager):
    m = BlockManager(num_blocks=4, block_size=4)
    prompt = [10, 11, 12, 13, 14, 15]
    assert m.allocate_slots(7, prompt, 6) == [0, 1]
    assert slots(m.block_table(7), 0, 6, 4) == [0, 1, 2, 3, 4, 5]
    assert m.allocate_slots(7, prompt + [20], 7) == [0, 1]
    assert m.allocate_slots(7, prompt + [20, 21], 8) == [0, 1]
    assert m.allocate_slots(7, prompt + [20, 21, 22], 9) == [0, 1, 2]  # position 8 opens block 2
    assert slots(m.block_table(7), 8, 9, 4) == [8]
    assert m.get_num_free_blocks() == 1
    m.free(7)
    assert m.get_num_free_blocks() == 4


def test_exhaustion_says_no_and_changes_nothing(BlockManager):
    m = BlockManager(num_blocks=3, block_size=4)
    assert m.allocate_slots(1, list(range(8)), 8) == [0, 1]
    before = (copy.deepcopy(m.block_tables), list(m.allocator.ref_counts), list(m.allocator.free_list))
    assert m.allocate_slots(2, list(range(100, 109)), 9) is None  # needs 3 blocks, 1 is free
    assert m.allocate_slots(1, list(range(13)), 13) is None  # needs 2 more blocks
    assert (m.block_tables, m.allocator.ref_counts, list(m.allocator.free_list)) == before
    assert 2 not in m.block_tables


def test_prefix_hit_shares_full_blocks_and_never_the_last_token(BlockManager):
    m = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert m.allocate_slots(1, prompt, 10) == [0, 1, 2]
    assert m.lookup_prefix(prompt) == 8
    assert m.lookup_prefix(prompt[:9]) == 8
    assert m.lookup_prefix(prompt[:8]) == 4  # 8 tokens: the 8th must be computed, so only block 0 is reused
    assert m.lookup_prefix([0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0  # block 0 differs -> so does everything after it
    assert m.allocate_slots(2, prompt, 10) == [0, 1, 3]
    assert [m.allocator.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert (m.stats.queried_tokens, m.stats.hit_tokens, m.stats.hit_blocks) == (20, 8, 2)
    assert m.stats.hit_rate == 8 / 20


def test_freed_cached_blocks_are_revived_then_evicted_lru(BlockManager):
    m = BlockManager(num_blocks=4, block_size=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 51, 52, 53, 54]
    assert m.allocate_slots(1, a, 9) == [0, 1, 2]
    m.free(1)  # freed last block first: free list [3, 2, 1, 0]
    assert list(m.allocator.free_list) == [3, 2, 1, 0]
    assert m.get_num_free_blocks() == 4  # cached but unused blocks count as free
    assert m.allocate_slots(2, b, 5) == [3, 2]  # block 2 held a's partial tail: never cached, reused
    assert m.lookup_prefix(a) == 8  # blocks 0 and 1 still cached
    assert m.allocate_slots(3, [9, 9, 9, 9], 4) == [1]  # LRU: evicts a's block 1, a's block 0 stays cached
    assert m.stats.evicted_blocks == 1
    assert m.lookup_prefix(a) == 4
    # a again: block 0 is a hit, but reviving it takes it off the free list, so 1 + 2 new > 1 free
    assert m.allocate_slots(4, a, 9) is None
    m.free(2)  # free list [0, 2, 3]
    assert m.allocate_slots(4, a, 9) == [0, 2, 3]
    assert m.stats.hit_blocks == 1


def test_fork_shares_blocks_and_copies_on_write(BlockManager):
    m = BlockManager(num_blocks=6, block_size=4)
    assert m.allocate_slots(1, [1, 2, 3, 4, 5, 6], 6) == [0, 1]
    m.fork(1, 2)
    assert m.block_table(2) == [0, 1] and m.allocator.ref_count(1) == 2
    # the child writes position 6 into the shared partial block 1: it gets its own copy, block 2
    assert m.allocate_slots(2, [1, 2, 3, 4, 5, 6, 7], 7) == [0, 2]
    assert m.take_copies() == [(1, 2)] and m.take_copies() == []
    assert [m.allocator.ref_count(b) for b in range(3)] == [2, 1, 1]
    # the parent now holds block 1 alone and writes into it in place
    assert m.allocate_slots(1, [1, 2, 3, 4, 5, 6, 8], 7) == [0, 1]
    assert m.take_copies() == []
    m.free(1), m.free(2)
    assert m.get_num_free_blocks() == 6


def test_free_unknown_sequence_is_a_noop_and_fork_checks_ids(BlockManager):
    m = BlockManager(num_blocks=2, block_size=4)
    m.free(123)
    m.allocate_slots(1, [1], 1)
    with pytest.raises(ValueError, match="already"):
        m.fork(1, 1)


def test_hash_collision_is_caught_by_comparing_tokens(BlockManager, monkeypatch):
    # Every block hashes to 0: without comparing tokens, any prompt would "hit" the first cached block.
    monkeypatch.setattr(PrefixCache, "hash_block", staticmethod(lambda parent, tokens: 0))
    m = BlockManager(num_blocks=8, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    m.allocate_slots(1, a, 9)
    assert m.lookup_prefix([9, 9, 9, 9, 9]) == 0  # same hash, other tokens: a miss
    assert m.lookup_prefix(a) == 4  # block 0 is found; block 1 collides with block 0's entry: its parent differs
    assert m.allocate_slots(2, [9, 9, 9, 9, 9], 5) == [3, 4]


def test_a_block_is_cached_only_under_its_own_parent(BlockManager):
    # A hash with 3 values. D's block 0 takes hash 0; C's block 0 (other tokens) hashes to 0 too, so it is not
    # cached. C's block 1 must not be cached either: under parent hash 0 it would be found after D's block 0,
    # and its K/V were computed after C's block 0.
    class Colliding(PrefixCache):
        hash_block = staticmethod(lambda parent, tokens: sum(tokens) % 3)

    m = BlockManager(num_blocks=10, block_size=4, prefix_cache=Colliding())
    assert m.allocate_slots("D", [0, 0, 0, 3, 1, 0, 0, 0, 9], 9) == [0, 1, 2]
    assert m.allocate_slots("C", [0, 0, 0, 0, 2, 0, 0, 0, 9], 9) == [3, 4, 5]
    assert sorted(m.prefix_cache.entries) == [0, 1]  # D's two full blocks; none of C's
    assert m.lookup_prefix([0, 0, 0, 3, 2, 0, 0, 0, 5]) == 4  # D's block 0, then C's block 1 tokens: one block
    assert m.lookup_prefix([0, 0, 0, 3, 1, 0, 0, 0, 5]) == 8


def test_hits_are_pinned_before_new_blocks_are_allocated(BlockManager):
    m = BlockManager(num_blocks=4, block_size=4)
    a = [1, 2, 3, 4, 5]
    assert m.allocate_slots(1, a, 5) == [0, 1]  # block 0 full: cached
    m.free(1)  # free list [2, 3, 1, 0]
    assert m.allocate_slots(2, [9] * 9, 9) == [2, 3, 1]
    m.free(2)  # free list [0, 1, 3, 2]: a's cached block 0 is at the front, the next to be handed out
    assert list(m.allocator.free_list) == [0, 1, 3, 2]
    # a's block 0 is a hit. Allocating the new block first would pop block 0 itself (and evict it): [0, 0].
    assert m.allocate_slots(3, a + [6], 6) == [0, 1]
    assert [m.allocator.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert (m.stats.hit_blocks, m.stats.evicted_blocks) == (1, 0)  # block 1 held a's uncached tail


def test_full_blocks_are_registered_as_they_are_computed(BlockManager):
    m = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert m.allocate_slots(1, prompt, 3) == [0]  # a first chunk [0, 3): no block full yet
    assert m.lookup_prefix(prompt) == 0
    assert m.allocate_slots(1, prompt, 6) == [0, 1]  # block 0 is full now
    assert m.lookup_prefix(prompt) == 4
    assert m.allocate_slots(1, prompt, 10) == [0, 1, 2]
    assert m.lookup_prefix(prompt) == 8  # block 2 holds 8, 9: partial, not registered
    assert m.allocate_slots(1, prompt + [10, 11], 12) == [0, 1, 2]  # two decodes fill block 2
    assert m.lookup_prefix(prompt + [10, 11, 12]) == 12
    assert m.allocate_slots(2, prompt + [10, 11, 12], 13) == [0, 1, 2, 3]  # a second sequence shares all three
    assert (m.stats.hit_tokens, m.stats.hit_blocks) == (12, 3)

    off = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert off.allocate_slots(1, prompt, 10) == [0, 1, 2]
    assert off.lookup_prefix(prompt) == 0 and off.prefix_cache.entries == {}
    assert off.allocate_slots(2, prompt, 10) == [3, 4, 5] and off.stats.hit_blocks == 0


def test_copy_on_write_needs_a_free_block_too(BlockManager):
    m = BlockManager(num_blocks=2, block_size=4)
    assert m.allocate_slots(1, [1, 2, 3, 4, 5, 6], 6) == [0, 1]
    m.fork(1, 2)
    before = (copy.deepcopy(m.block_tables), list(m.allocator.ref_counts), dict(m.num_slots))
    assert m.allocate_slots(2, [1, 2, 3, 4, 5, 6, 7], 7) is None  # its copy of block 1 has nowhere to go
    assert (m.block_tables, m.allocator.ref_counts, m.num_slots, m.pending_copies) == (*before, [])
    m.free(1)  # now the child holds block 1 alone: it writes in place, no copy
    assert m.allocate_slots(2, [1, 2, 3, 4, 5, 6, 7], 7) == [0, 1] and m.take_copies() == []


# ---------------------------------------------------------------------------------------------
# The state machine. A fake KV pool stands in for the tensors. A token's K/V depend on the token and
# on every token before it, so what the fake pool stores at a token's slot is that whole prefix,
# `pool[slot] = tuple(tokens[:p + 1])`; the machine checks after every step that each live sequence
# still reads back its own prefixes through its block table. Sharing a block that holds other tokens,
# or the same tokens computed after a different prefix, losing a write to a shared block, or reusing
# a block still in use breaks it.

NUM_BLOCKS, BS = 10, 4
SYSTEM = [7, 7, 1, 2, 3, 7, 1, 1, 2, 3, 3, 1]  # a shared "system prompt" of 3 blocks


class BlockManagerMachine(RuleBasedStateMachine):
    prefix_cache_cls = PrefixCache

    def __init__(self):
        super().__init__()
        BlockManager = implementation("nanoserve.kv.block_manager").BlockManager
        self.m = BlockManager(NUM_BLOCKS, BS, prefix_cache=self.prefix_cache_cls())
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.pool: dict[int, int] = {}
        self.next_id = 0

    def snapshot(self):
        m = self.m
        return (copy.deepcopy(m.block_tables), copy.deepcopy(m.block_hashes), dict(m.num_slots),
                list(m.allocator.ref_counts), list(m.allocator.free_list), dict(m.prefix_cache.entries),
                copy.copy(m.stats), list(m.pending_copies))

    def grow(self, seq_id, tokens, num_tokens):
        """allocate_slots, then (if it said yes) do the copies and write the new tokens, as the model runner would."""
        before = self.snapshot()
        table = self.m.allocate_slots(seq_id, tokens, num_tokens)
        if table is None:
            assert self.snapshot() == before, "a failed allocation changed the manager"
            return False
        assert len(table) * BS >= num_tokens
        for src, dst in self.m.take_copies():
            for o in range(BS):
                if src * BS + o in self.pool:
                    self.pool[dst * BS + o] = self.pool[src * BS + o]
        for p, slot in zip(range(self.computed[seq_id], num_tokens), slots(table, self.computed[seq_id], num_tokens, BS)):
            self.pool[slot] = tuple(tokens[:p + 1])
        self.computed[seq_id] = num_tokens
        return True

    @rule(system=st.sampled_from([0, 4, 6, 8, 12]), tail=st.lists(st.integers(0, 3), min_size=1, max_size=10), data=st.data())
    def add(self, system, tail, data):
        prompt = SYSTEM[:system] + tail
        hit = self.m.lookup_prefix(prompt)
        assert hit % BS == 0 and hit < len(prompt)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.computed[seq_id] = hit
        hit_tokens_before = self.m.stats.hit_tokens
        if self.grow(seq_id, prompt, hit + data.draw(st.integers(1, len(prompt) - hit))):
            self.tokens[seq_id] = prompt  # positions < hit were never written: the invariants check they are right
            assert self.m.stats.hit_tokens == hit_tokens_before + hit
        else:
            del self.computed[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_token=st.integers(0, 3))
    def step(self, data, new_token):
        """Prefill the next chunk, or decode one token once the prompt is done."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id]
        if self.computed[seq_id] < len(tokens):
            self.grow(seq_id, tokens, data.draw(st.integers(self.computed[seq_id] + 1, len(tokens))))
        elif self.grow(seq_id, tokens + [new_token], len(tokens) + 1):
            tokens.append(new_token)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][: self.computed[parent]])
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]

    @rule()
    def free_all(self):
        for seq_id in list(self.tokens):
            self.m.free(seq_id)
        self.tokens.clear(), self.computed.clear()
        assert self.m.get_num_free_blocks() == NUM_BLOCKS  # every block free or cached-evictable
        assert all(self.m.allocator.ref_count(b) == 0 for b in range(NUM_BLOCKS))

    @invariant()
    def ref_counts_equal_table_holders(self):
        held = [0] * NUM_BLOCKS
        for seq_id, table in self.m.block_tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id} holds a block twice: {table}"
            for b in table:
                held[b] += 1
        assert held == [self.m.allocator.ref_count(b) for b in range(NUM_BLOCKS)]
        free = set(self.m.allocator.free_list)
        assert free == {b for b in range(NUM_BLOCKS) if held[b] == 0}, "a block is both free and in use"
        assert self.m.get_num_free_blocks() == len(free) <= NUM_BLOCKS
        assert set(self.m.block_tables) == set(self.tokens)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, tokens in self.tokens.items():
            n = self.computed[seq_id]
            table = self.m.block_table(seq_id)
            assert [self.pool.get(s) for s in slots(table, 0, n, BS)] == [tuple(tokens[:p + 1]) for p in range(n)]

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for block_id, (_, _, tokens) in self.m.prefix_cache.entries.items():
            written = [self.pool.get(block_id * BS + o) for o in range(BS)]
            assert None not in written and [prefix[-1] for prefix in written] == list(tokens)


class CollidingPrefixCache(PrefixCache):
    """A terrible hash — 3 values for every block — so collisions happen all the time."""

    hash_block = staticmethod(lambda parent, tokens: sum(tokens) % 3)


class CollidingBlockManagerMachine(BlockManagerMachine):
    prefix_cache_cls = CollidingPrefixCache


STATE_MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = STATE_MACHINE_SETTINGS
TestBlockManagerWithHashCollisions = CollidingBlockManagerMachine.TestCase
TestBlockManagerWithHashCollisions.settings = STATE_MACHINE_SETTINGS
