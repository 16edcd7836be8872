"""Exercise 13.2 — applying packed token bitmasks to a batch of logits rows.

This file mirrors nanoserve/structured/bitmask.py; the engine calls your `apply_token_bitmask` on every
step that has constrained requests once it is finished (`--student 13`). The grader compares it with
xgrammar's own `apply_token_bitmask_inplace`.

xgrammar's layout: a row of ceil(vocab / 32) int32 words; token t is allowed when bit (t % 32) of word
t // 32 is 1 (bit 0 = the least significant). Bit 31 set makes the int32 negative.

Run `make grade CH=13` to grade it.
"""

import torch

BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(vocab_size / 32)) int32 -> (B, vocab_size) bool, True = allowed (padding bits past vocab_size
    are dropped).

        >>> unpack_bitmask(torch.tensor([[5]], dtype=torch.int32), 4).tolist()
        [[True, False, True, False]]
    """
    raise NotImplementedError("Exercise 13.2: unpack_bitmask — one bool per token from the int32 words")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: for each i, logits[rows[i], t] = -inf wherever token t is not allowed by bitmask[i].

    logits (N, vocab) float; bitmask (len(rows), words) int32; rows: distinct row indices into logits. Every
    row not in `rows` must stay exactly as it was (an unconstrained request shares the batch). rows may be
    empty.

        logits = torch.zeros(3, 4); apply_token_bitmask(logits, torch.tensor([[5]], dtype=torch.int32), [2])
        logits.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, -inf, 0, -inf]]   # row 2 only: tokens 1 and 3 masked
    """
    raise NotImplementedError("Exercise 13.2: apply_token_bitmask — -inf on the disallowed tokens of the given rows")
