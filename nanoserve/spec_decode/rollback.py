"""Chapter 14 — rollback in a paged cache: the slots of rejected tokens go back.

To verify k proposals the scheduler grew the sequence's block table to cover them, and the forward pass
wrote their K/V. After acceptance only `num_tokens` positions hold K/V of real tokens; the rest are
garbage. Shrink the table to what covers those positions, and give whole blocks past them back to the pool:

    block_size 4, 6 tokens computed, 4 proposals verified -> table covered 11 positions: [3, 8, 5]
    1 accepted -> 7 positions hold real K/V: cdiv(7, 4) = 2 blocks -> [3, 8], block 5 back in the pool
    slots 7..10 of those are free to be overwritten: the next step writes the bonus token at position 7

Nothing rejected is ever in the prefix cache: BlockManager registers only full blocks of the token ids it
is given, and the scheduler gives it the sequence's real tokens, never the proposals. So the freed blocks
hold no hash and the kept ones hold only accepted tokens (rollback_slots checks it).
"""

from nanoserve.kv.block_manager import cdiv


def rollback_slots(block_manager, seq_id: str, num_tokens: int) -> list[int]:
    """Shrink `seq_id`'s block table to cover positions [0, num_tokens); return the blocks given back."""
    table = block_manager.block_tables[seq_id]
    keep = cdiv(num_tokens, block_manager.block_size)
    if len(block_manager.block_hashes[seq_id]) > num_tokens // block_manager.block_size:
        raise RuntimeError(f"{seq_id!r}: a block past position {num_tokens} is in the prefix cache")
    freed = table[keep:]
    del table[keep:]
    for block_id in reversed(freed):
        block_manager.allocator.free(block_id)
    block_manager.num_slots[seq_id] = min(block_manager.num_slots[seq_id], num_tokens)
    return freed
