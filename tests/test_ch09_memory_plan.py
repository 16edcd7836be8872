"""Chapter 09 — chapter 04's memory plan in whole blocks, against numbers worked out by hand."""

import pytest

from nanoserve.memory import GiB, paged_memory_plan
from nanoserve.model.config import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS


def test_smollm2_fp32_by_hand():
    # budget = 2 GiB − 0.1 · 2 GiB − 134,515,008 · 4 B − 1000 tokens · 7296 floats · 4 B
    budget = 2 * GiB - 0.1 * 2 * GiB - 134_515_008 * 4 - 1000 * 7296 * 4
    plan = paged_memory_plan(LlamaConfig(), 2 * GiB, 1000, block_size=16, dtype="fp32")
    assert plan.block_bytes == 16 * 46_080
    assert plan.num_blocks == int(budget // (16 * 46_080)) == 1852
    assert plan.blocks_per_sequence == 63 and plan.wasted_slots_per_sequence == 63 * 16 - 1000 == 8
    assert plan.num_sequences == 1852 // 63 == 29


@pytest.mark.parametrize("block_size, blocks_per_seq, wasted", [(1, 4096, 0), (16, 256, 0), (100, 41, 4)])
def test_llama3_8b_blocks(block_size, blocks_per_seq, wasted):
    plan = paged_memory_plan(KNOWN_CONFIGS["llama-3-8b"], 80 * GiB, 4096, block_size, "bf16")
    assert plan.blocks_per_sequence == blocks_per_seq and plan.wasted_slots_per_sequence == wasted
    assert plan.block_bytes == block_size * 131_072
    # whole blocks can never hold more sequences than the byte count allows (chapter 04 says 113)
    assert plan.num_sequences <= 113 and (block_size > 16 or plan.num_sequences == 113)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        paged_memory_plan(LlamaConfig(), GiB, 100, block_size=0)
