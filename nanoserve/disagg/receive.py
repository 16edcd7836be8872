"""Chapter 17 — where a transferred prompt's KV lands on the receiving side (exercise 17.1).

The decode engine admits a request whose prompt the prefill engine already computed. Two questions, all
integers (the scheduler's side of the connector asks them; no tensor is touched):

  1. how many tokens to receive: the remote engine computed `num_remote_tokens` of the prompt; the leading
     `num_computed_tokens` are here already (this engine's prefix cache hit them: whole blocks); the last
     prompt token is always computed here, because its forward pass is what samples the first output token.
  2. where they land: the pool slots of those positions in this engine's own block table — never the
     producer's block ids, which mean nothing here.

    prompt 10 tokens, remote computed 10, local prefix hit 4 (one block of 4):
        receive 10 - 1 - 4 = 5 tokens, positions [4, 9);   table [7, 2, 5]:  slots [8, 9, 10, 11, 20]
"""

from nanoserve.kv.block_manager import slot_mapping


def num_tokens_to_receive(num_prompt_tokens: int, num_remote_tokens: int, num_computed_tokens: int) -> int:
    """Tokens [num_computed_tokens, num_computed_tokens + result) come from the remote engine.

    >>> num_tokens_to_receive(10, 10, 4)    # all but the last prompt token, minus the local hit
    5
    >>> num_tokens_to_receive(10, 10, 8)    # the hit covers [0, 8): one token to receive
    1
    >>> num_tokens_to_receive(10, 6, 8)     # the remote holds less than we do: nothing
    0
    """
    return max(0, min(num_remote_tokens, num_prompt_tokens - 1) - num_computed_tokens)


def receive_slots(block_table: list[int], num_computed_tokens: int, num_tokens: int, block_size: int) -> list[int]:
    """The slots (block · block_size + offset) of positions [num_computed_tokens, + num_tokens) in `block_table`.

    >>> receive_slots([7, 2, 5], 4, 5, block_size=4)
    [8, 9, 10, 11, 20]
    """
    return slot_mapping(block_table, num_computed_tokens, num_computed_tokens + num_tokens, block_size)
