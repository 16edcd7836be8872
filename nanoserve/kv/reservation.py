"""Chapter 05 — the baseline paging replaced: reserve a request's whole possible length when it is admitted.

Before paged KV, a serving system gave each request one contiguous stretch of KV memory for everything it
might ever hold — prompt + max_tokens (or the model's whole context) — at admission, because the model
decides later when to stop (chapter 04's naive cache). `ReservingBlockManager` does the same in blocks:
a sequence's first `allocate_slots` takes the blocks for `max_total_tokens(seq_id)` tokens, and it never
grows again. A running sequence then never runs out (no preemption), but a request is admitted only
when its whole reservation fits, so fewer run at once in the same memory.

    blocks of 4, a request of 6 prompt tokens + max_tokens 6:
      paged       allocate_slots(.., 6) -> 2 blocks; a third at the 9th token
      reserving   allocate_slots(.., 6) -> 3 blocks at once (cdiv(12, 4)); nothing more, ever

Used only by `python -m nanoserve bench paged-kv --memory-cap-mib N`, which compares it with the real
BlockManager under the same memory; the engine itself always pages.
"""

from collections.abc import Callable, Sequence

from nanoserve.kv.block_manager import BlockManager


class ReservingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, max_total_tokens: Callable[[str], int]):
        """max_total_tokens(seq_id): the tokens to reserve for a sequence (its prompt + max_tokens)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.max_total_tokens = max_total_tokens

    def allocate_slots(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        if seq_id not in self.block_tables:  # admission: all of it now, or nothing
            num_tokens = max(num_tokens, self.max_total_tokens(seq_id))
        return super().allocate_slots(seq_id, token_ids, num_tokens)
