"""Chapter 13 — applying packed token bitmasks to logits rows (exercise 13.2).

xgrammar packs a row's allowed tokens 32 to an int32 word: token t is bit (t % 32) of word t // 32,
1 = allowed. A 49,152-token vocabulary is 1,536 words (6 KiB) per row instead of 49,152 booleans:

    word 0 = 0b...0101   -> tokens 0 and 2 allowed, 1 and 3..31 not
    (int32: bit 31 set reads as a negative number; `>>` on int32 is arithmetic, `& 1` keeps only the bit)

Only the rows of constrained requests are touched: `rows[i]` is the logits row that bitmask row i
masks, every other row keeps its exact values (an unconstrained neighbour samples what it samples alone).
A masked logit becomes -inf *before* temperature, top-k and top-p, so they all see only allowed tokens.
"""

import torch

BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(vocab / 32)) int32 -> (B, vocab_size) bool, True = allowed.

        >>> unpack_bitmask(torch.tensor([[5]], dtype=torch.int32), 4).tolist()
        [[True, False, True, False]]
    """
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, words, 32)
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0. logits (N, vocab), bitmask
    (len(rows), words); rows not listed are left exactly as they are."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # (len(rows), vocab)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
