"""Exercise 14.4 — rollback of the block table and slots after a verification.

Your version of nanoserve/spec_decode/rollback.py: same function. Replace the
`raise NotImplementedError` with your code, then run `make grade CH=14 EX=14.4`.
"""


def rollback_slots(block_manager, seq_id: str, num_tokens: int) -> list[int]:
    """Exercise 14.4. After verification only positions [0, num_tokens) of `seq_id` hold K/V of real tokens.

    Shrink the sequence's block table (block_manager.block_tables[seq_id], changed in place) to the blocks
    that cover those positions, give each block past them back to the pool (block_manager.allocator.free),
    and lower block_manager.num_slots[seq_id] to num_tokens if it is above. Raise RuntimeError if one of the
    sequence's prefix-cached blocks (block_manager.block_hashes[seq_id]: one hash per registered full block,
    from block 0 on) lies past position num_tokens: it would mean a rejected token was cached.
    Returns the block ids given back, in table order.

        block_size 4, table [3, 8, 5] (10 positions covered), num_tokens 7 -> table [3, 8], returns [5]
    """
    raise NotImplementedError("Exercise 14.4: shrink the table, free the blocks past num_tokens")
