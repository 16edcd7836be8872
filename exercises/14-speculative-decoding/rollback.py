"""Exercise 14.4 — rollback of the block table and slots after a verification.

Your version of nanoserve/spec_decode/rollback.py: same function. Replace the
`raise NotImplementedError` with your code, then run `make grade CH=14 EX=14.4`.
"""


def rollback_slots(block_manager, seq_id: str, num_tokens: int) -> list[int]:
    """Exercise 14.4. After verification only positions [0, num_tokens) of `seq_id` hold K/V of real tokens
    (the tokens it had, plus the accepted proposals); the slots past them hold K/V of rejected ones.

    Shrink the sequence's block table to the blocks that cover those positions, the rest back to the pool,
    through block_manager.shrink(seq_id, num_blocks_to_keep, num_slots) (it frees, and lowers the positions
    the table covers). Raise RuntimeError first if one of the sequence's prefix-cached blocks
    (block_manager.block_hashes[seq_id]: one hash per registered full block, from block 0 on) holds a
    position >= num_tokens: it would mean a rejected token was cached. block_manager.block_size is the block
    size. Returns the block ids given back, in table order.

        block_size 4; a sequence of 6 tokens verified 4 proposals: its table covers positions 0..9, [3, 8, 5]
        1 accepted -> num_tokens 7 -> table [3, 8], returns [5]; the next step writes position 7
        all 4 accepted -> num_tokens 10 -> returns [], the table unchanged
    """
    raise NotImplementedError("Exercise 14.4: which blocks cover the real tokens; the rest back to the pool")
