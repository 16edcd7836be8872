"""Exercise 13.3 — a grammar matcher kept in step with the engine's sequence: advance and roll back.

This file mirrors nanoserve/structured/matcher.py; the engine syncs one of your SequenceMatchers per
constrained completion before every step once it is finished (`--student 13`). The grader checks the masks
it gives after each sync against a fresh xgrammar matcher fed the same tokens from scratch.

xgrammar's GrammarMatcher, the one you drive: `accept_token(id) -> bool` (False: refused, state unchanged),
`rollback(k)` (undo the last k accepted tokens), `fill_next_token_bitmask(bitmask, row)`, `is_terminated()`.

Run `make grade CH=13` to grade it.
"""

import xgrammar as xgr

from nanoserve.structured.matcher import GrammarViolation  # noqa: F401  (given: raise it, the engine catches it)


class SequenceMatcher:
    """xgrammar's GrammarMatcher plus the tokens it has accepted (given)."""

    def __init__(self, grammar: "xgr.CompiledGrammar"):
        self.matcher = xgr.GrammarMatcher(grammar)
        self.tokens: list[int] = []  # accepted so far, in order

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to the state after exactly `output_token_ids` (the sequence's output tokens now).

        Contract: after sync(ids), this matcher is indistinguishable from a fresh SequenceMatcher fed `ids` —
        the same self.tokens (== ids), the same mask from fill, the same is_terminated — whatever it held before
        (a longer, shorter or different history). If the grammar refuses one of `ids`, raise GrammarViolation.

            fresh = SequenceMatcher(grammar); fresh.sync([A, B, E])
            m.sync([A, B, C, D]); m.sync([A, B, E])   ->  m.tokens == fresh.tokens == [A, B, E], same fill
        """
        raise NotImplementedError("Exercise 13.3: SequenceMatcher.sync")

    def fill(self, bitmask, row: int) -> None:
        """Write the next-token mask into bitmask[row] (given)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted (given)."""
        return self.matcher.is_terminated()
