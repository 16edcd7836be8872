"""Exercise 17 — where a transferred prompt's KV lands on the receiving side (mirrors nanoserve/disagg/receive.py).

The decode engine admits a request whose prompt a prefill engine already computed. The connector's scheduler
side asks two questions, in integers only:

    17.1  num_tokens_to_receive(num_prompt_tokens, num_remote_tokens, num_computed_tokens)   how many
          receive_slots(block_table, num_computed_tokens, num_tokens, block_size)            where they land
"""


def num_tokens_to_receive(num_prompt_tokens: int, num_remote_tokens: int, num_computed_tokens: int) -> int:
    """Exercise 17.1. How many prompt tokens, starting at position num_computed_tokens, this engine loads from
    the remote engine instead of computing them.

    num_prompt_tokens: the prompt's length (>= 1); num_remote_tokens: the leading positions the remote engine
    staged; num_computed_tokens: the leading positions this engine's prefix cache already holds (whole blocks).
    Invariants: the result is >= 0; the last prompt position is never received (its forward pass here is what
    samples the first output token); positions this engine holds are never received again.

    >>> num_tokens_to_receive(10, 10, 4)
    5
    """
    raise NotImplementedError("Exercise 17.1: num_tokens_to_receive")


def receive_slots(block_table: list[int], num_computed_tokens: int, num_tokens: int, block_size: int) -> list[int]:
    """Exercise 17.1. The pool slots (block id · block_size + offset in the block) of positions
    [num_computed_tokens, num_computed_tokens + num_tokens) in this engine's own `block_table`, one per position,
    in order. ValueError if the table has too few blocks for them.

    >>> receive_slots([7, 2, 5], 4, 5, block_size=4)
    [8, 9, 10, 11, 20]
    """
    raise NotImplementedError("Exercise 17.1: receive_slots")
