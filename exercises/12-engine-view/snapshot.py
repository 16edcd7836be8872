"""Exercises 12.1 and 12.2 — what the live page draws: each KV block's owner, and each step's kind.

This file mirrors two functions of nanoserve/engine/snapshot.py; the rest of the snapshot builder
(queues, events, step records) is given and calls yours once they are written.

Run `make grade CH=12` to grade them, and `python -m nanoserve serve --student 12 --num-blocks 16`, then
open http://127.0.0.1:8000/engine, to watch the page draw the pool with your code (each function serves as soon as it
is written; the other is the reference's until then).
"""


def block_owners(block_tables: dict[str, list[int]], num_blocks: int, cached_blocks) -> list[str]:
    """One owner per block id in [0, num_blocks):

        "shared:k"   the block is in k >= 2 of the block tables (a prefix hit, or a fork)
        the seq id   it is in exactly one table, that sequence's
        "cached"     it is in no table, but its id is in `cached_blocks` (free, yet a prefix hit can revive it)
        "free"       in no table and not cached

    >>> block_owners({"a": [0, 1], "b": [0, 2]}, 6, cached_blocks={3})
    ['shared:2', 'a', 'b', 'cached', 'free', 'free']
    """
    raise NotImplementedError("Exercise 12.1: block_owners — one owner per block, from the block tables")


def step_kind(num_computed_before: int, num_scheduled: int, num_tokens_before: int, num_prompt_tokens: int) -> str:
    """What one sequence's step was, for the timeline: "decode" when its work is a decode's (the step takes the
    sequence one generated token further, from a cache that holds everything before it), "prefill" for any other
    work: its prompt, whole or a chunk, or the recompute of a preempted sequence, whose generated tokens are
    computed again like a prompt. A recompute the prefix cache covers up to its last token has a decode's work left.

    The counts are the sequence's before the step: tokens [num_computed_before, num_computed_before +
    num_scheduled) are computed, out of num_tokens_before (its num_prompt_tokens prompt tokens, then the generated
    ones so far).

    >>> step_kind(10, 1, 11, 10), step_kind(0, 8, 10, 10), step_kind(9, 1, 10, 10)
    ('decode', 'prefill', 'prefill')
    """
    raise NotImplementedError("Exercise 12.2: step_kind — is this step a decode or (a chunk of) a prefill?")
