"""Chapter 05, exercise 5.3 (graded): slot_mapping and AttentionMetadata.build — every expected slot,
table and offset below is worked out by hand from `slot = block_table[p // block_size] * block_size + p % block_size`."""

import pytest
import torch

from nanoserve.student import implementation

pytestmark = pytest.mark.exercise("5.3")


@pytest.fixture
def slot_mapping():
    return implementation("nanoserve.kv.block_manager").slot_mapping


@pytest.fixture
def AttentionMetadata():
    return implementation("nanoserve.kv.paged_attention").AttentionMetadata


def test_slot_mapping_worked_example(slot_mapping):
    assert slot_mapping([5, 2], 2, 7, block_size=4) == [22, 23, 8, 9, 10]  # 2, 3 in block 5; 4, 5, 6 in block 2
    assert slot_mapping([3], 0, 0, block_size=4) == []


def test_slot_mapping_crosses_blocks_in_table_order(slot_mapping):
    # block_size 3, table [7, 0, 4]: positions 0..2 -> 21..23, 3..5 -> 0..2, 6..8 -> 12..14
    assert slot_mapping([7, 0, 4], 0, 9, block_size=3) == [21, 22, 23, 0, 1, 2, 12, 13, 14]
    assert slot_mapping([7, 0, 4], 5, 7, block_size=3) == [2, 12]  # a decode-sized window across a boundary
    assert slot_mapping([9, 1], 1, 2, block_size=1) == [1]  # block_size 1: a slot is a block


def test_slot_mapping_refuses_a_short_table(slot_mapping):
    assert slot_mapping([3], 3, 4, block_size=4) == [15]  # the last slot of the only block is fine
    with pytest.raises(ValueError, match="blocks"):
        slot_mapping([3], 0, 5, block_size=4)  # position 4 needs a second block


def test_build_worked_example(AttentionMetadata):
    m = AttentionMetadata.build([[3], [0, 2]], seq_lens=[3, 6], query_lens=[3, 1], block_size=4)
    assert m.slot_mapping.tolist() == [12, 13, 14, 9]  # seq 0: positions 0..2 in block 3; seq 1: position 5 = block 2, offset 1
    assert m.block_tables.tolist() == [[3, 0], [0, 2]]  # seq 0's table padded with block 0
    assert m.seq_lens.tolist() == [3, 6] and m.cu_seqlens_q.tolist() == [0, 3, 4]
    assert all(t.dtype == torch.long for t in (m.slot_mapping, m.block_tables, m.seq_lens, m.cu_seqlens_q))


def test_build_a_mixed_step(AttentionMetadata):
    """A decodes position 9, B prefills its first chunk [0, 3), C computes [5, 7) on top of a cached prefix."""
    m = AttentionMetadata.build([[4, 1, 6], [2], [5, 0]], seq_lens=[10, 3, 7], query_lens=[1, 3, 2], block_size=4)
    # A: position 9 = block 6, offset 1 -> 25; B: 8, 9, 10; C: positions 5, 6 = block 0, offsets 1, 2 -> 1, 2
    assert m.slot_mapping.tolist() == [25, 8, 9, 10, 1, 2]
    assert m.block_tables.tolist() == [[4, 1, 6], [2, 0, 0], [5, 0, 0]]
    assert m.seq_lens.tolist() == [10, 3, 7] and m.cu_seqlens_q.tolist() == [0, 1, 4, 6]
    assert isinstance(m, AttentionMetadata)


def test_build_refuses_bad_input(AttentionMetadata):
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([[0]], seq_lens=[2], query_lens=[3], block_size=4)  # more queries than positions
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([[0]], seq_lens=[2], query_lens=[0], block_size=4)  # a sequence with nothing to do
    with pytest.raises(ValueError):
        AttentionMetadata.build([[0], [1]], seq_lens=[2], query_lens=[1], block_size=4)  # two tables, one length
