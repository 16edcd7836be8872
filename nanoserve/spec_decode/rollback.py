"""Chapter 14 — rollback in a paged cache: the slots of rejected tokens go back.

To verify k proposals the scheduler grew the sequence's block table to cover them, and the forward pass
wrote their K/V. After acceptance only the sequence's real tokens — the ones it had, plus the accepted
proposals — hold K/V; the slots past them hold K/V of rejected tokens. Shrink the table to the blocks that
cover the real positions, and give whole blocks past them back to the pool (BlockManager.shrink):

    block_size 4; a sequence of 6 tokens (5 computed, the 6th sampled last step) verifies 4 proposals:
      the step computes positions 5..9 (the 6th token, then d_1..d_4): the table covers 10 -> [3, 8, 5]
    1 accepted -> positions [0, 7) hold real K/V: cdiv(7, 4) = 2 blocks -> [3, 8], block 5 back in the pool
    the correction token is the 8th token, at position 7: the next step writes it over d_2's garbage

Nothing rejected is ever in the prefix cache: BlockManager registers only full blocks of the token ids it
is given, and the scheduler gives it the sequence's real tokens, never the proposals. So every registered
block lies inside [0, num_tokens) (rollback_slots checks it), and the freed blocks hold no hash.
"""

from nanoserve.kv.block_manager import cdiv


def rollback_slots(block_manager, seq_id: str, num_tokens: int) -> list[int]:
    """Shrink `seq_id`'s block table to cover positions [0, num_tokens); return the blocks given back."""
    bs = block_manager.block_size
    if len(block_manager.block_hashes[seq_id]) > num_tokens // bs:  # a cached block holding a position >= num_tokens
        raise RuntimeError(f"{seq_id!r}: a block past position {num_tokens} is in the prefix cache")
    return block_manager.shrink(seq_id, cdiv(num_tokens, bs), num_tokens)
