"""Chapter 13 — applying packed token bitmasks to logits rows (exercise 13.2).

xgrammar packs a row's allowed tokens 32 to an int32 word: token t is bit (t % 32) of word t // 32,
1 = allowed. A 49,152-token vocabulary is 1,536 words (6 KiB) per row instead of 49,152 booleans:

    word 0 = 0b...0101   -> tokens 0 and 2 allowed, 1 and 3..31 not
    (int32: bit 31 set reads as a negative number, which is why we never do arithmetic on the words)

Unpacking reads each word as its 4 bytes (little-endian, as on every machine we run on: byte k holds
tokens 8k .. 8k + 7 of the word) and looks each byte up in a 256 x 8 table of its bits, so no int32
temporary 32 times the mask's size is ever built.

Only the rows of constrained requests are touched: `rows[i]` is the logits row that bitmask row i
masks, every other row keeps its exact values (an unconstrained neighbour samples what it samples alone).
A masked logit becomes -inf *before* temperature, top-k and top-p, so they all see only allowed tokens.
"""

import torch

BITS = 32
_BYTE_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # (256, 8): bit j of byte b


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(vocab / 32)) int32 -> (B, vocab_size) bool, True = allowed.

        >>> unpack_bitmask(torch.tensor([[5]], dtype=torch.int32), 4).tolist()
        [[True, False, True, False]]
    """
    as_bytes = bitmask.contiguous().view(torch.uint8)  # (B, 4 * words), little-endian: token order
    bits = _BYTE_BITS.to(bitmask.device)[as_bytes.long()]  # (B, 4 * words, 8)
    return bits.flatten(1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0. logits (N, vocab), bitmask
    (len(rows), words); rows not listed are left exactly as they are."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # (len(rows), vocab)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
