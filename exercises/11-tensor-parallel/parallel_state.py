"""Exercise 11.5 — the step broadcast (mirrors `pack_step` and `unpack_step` of nanoserve/distributed/parallel_state.py).

Rank 0 sends each engine step to the other ranks as integers only: one header of at most 8 integers
(the command, the payload's length, then the sizes `pack_step` returns), then one flat int64 tensor. Everything
else of parallel_state.py (the group, its collectives) is given. Read chapter 11, section 4, first. Grade with
`make grade CH=11 EX=11.5`.
"""

import torch

from nanoserve.distributed.parallel_state import HEADER_LEN, STEP_FIELDS  # noqa: F401  (given: the wire format)


def pack_step(batch, blocks_to_copy=()) -> tuple[tuple[int, ...], torch.Tensor]:
    """Exercise 11.5. A ModelInput (`batch`: input_ids, positions, attn_metadata with slot_mapping, block_tables,
    seq_lens, cu_seqlens_q; logits_indices) and the step's copy-on-write pairs [(src, dst), ...] -> (sizes, payload).

    sizes: (num_tokens, num_seqs, max_blocks, num_sampled, num_copies), few enough to ride in the header;
    payload: every field of STEP_FIELDS, in that order, flattened into one int64 tensor (block_tables row by
    row, the copies pair by pair). Example: 3 sequences, 5 tokens, tables 2 blocks wide, 2 rows sampled, 1 copy:
    sizes (5, 3, 2, 2, 1) and 5·3 + 6 + 3 + 4 + 2 + 2 = 32 integers, 256 bytes. No copies: num_copies 0.
    """
    raise NotImplementedError("Exercise 11.5: a step's integers, flat")


def unpack_step(sizes: list[int], payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exercise 11.5. The inverse of pack_step on the other ranks: {name: tensor} for every name of STEP_FIELDS,
    each of the shape it had (block_tables (num_seqs, max_blocks), blocks_to_copy (num_copies, 2), the others
    1-d). `sizes` is what the header carried: it may hold trailing zeros after the five sizes."""
    raise NotImplementedError("Exercise 11.5: the step's tensors back from the flat payload")
