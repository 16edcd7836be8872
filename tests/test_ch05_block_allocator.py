"""Chapter 05, exercise 5.1 (graded): the block allocator — hand-computed free lists and ref counts,
and the learner's allocator running the real block manager."""

import pytest

from nanoserve.kv.block_manager import BlockManager
from nanoserve.student import implementation

pytestmark = pytest.mark.exercise("5.1")


@pytest.fixture
def BlockAllocator():
    return implementation("nanoserve.kv.block_allocator").BlockAllocator


def test_worked_example(BlockAllocator):
    a = BlockAllocator(4)
    assert a.get_num_free_blocks() == 4 and a.can_allocate(4) and not a.can_allocate(5)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) is None  # only 2 free
    assert a.get_num_free_blocks() == 2 and [a.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    a.incref(1)
    assert a.ref_count(1) == 2
    a.free(1)
    a.free(0)
    assert [a.ref_count(b) for b in range(4)] == [0, 1, 0, 0]
    assert a.allocate(3) == [2, 3, 0]  # LRU: block 0 was freed last, so it comes last
    assert a.get_num_free_blocks() == 0 and a.allocate(1) is None
    assert a.allocate(0) == []


def test_free_list_is_lru(BlockAllocator):
    a = BlockAllocator(5)
    assert a.allocate(5) == [0, 1, 2, 3, 4]
    for b in [3, 0, 4]:
        a.free(b)
    assert a.allocate(2) == [3, 0]
    a.free(1)
    assert a.allocate(2) == [4, 1]


def test_incref_revives_a_free_block(BlockAllocator):
    a = BlockAllocator(3)
    a.allocate(3)
    a.free(0), a.free(1), a.free(2)  # free list [0, 1, 2]
    a.incref(1)  # a prefix hit on the cached block 1: in use again
    assert a.ref_count(1) == 1 and a.get_num_free_blocks() == 2
    assert a.allocate(2) == [0, 2] and a.allocate(1) is None


def test_a_failed_allocation_changes_nothing(BlockAllocator):
    a = BlockAllocator(3)
    a.allocate(2)
    assert a.allocate(2) is None
    assert a.get_num_free_blocks() == 1 and [a.ref_count(b) for b in range(3)] == [1, 1, 0]
    assert a.allocate(1) == [2]


def test_bad_input_is_a_value_error(BlockAllocator):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    a = BlockAllocator(2)
    with pytest.raises(ValueError, match="double free"):
        a.free(0)
    with pytest.raises(ValueError):
        a.ref_count(2)
    with pytest.raises(ValueError):
        a.incref(-1)
    with pytest.raises(ValueError):
        a.allocate(-1)


def test_it_runs_the_block_manager(BlockAllocator):
    """Your allocator under the real block manager: a shared prompt, a prefix hit, exhaustion, release."""
    m = BlockManager(num_blocks=6, block_size=4, allocator=BlockAllocator(6))
    prompt = list(range(10))
    assert m.allocate_slots("a", prompt, 10) == [0, 1, 2]
    assert m.allocate_slots("b", prompt, 10) == [0, 1, 3]  # blocks 0 and 1 shared
    assert m.allocator.ref_count(0) == 2 and m.get_num_free_blocks() == 2
    assert m.allocate_slots("c", list(range(50, 62)), 12) is None
    m.free("a"), m.free("b")
    assert m.get_num_free_blocks() == 6
    assert m.lookup_prefix(prompt) == 8  # freed, but still cached
    assert m.allocate_slots("c", prompt, 10) == [0, 1, 4]  # free list was [4, 5, 2, 3, 1, 0]: hits 0, 1 + new 4
