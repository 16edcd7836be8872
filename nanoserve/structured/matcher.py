"""Chapter 13 — one completion's grammar state, kept in step with the engine's sequence (exercise 13.3).

A matcher is a parser paused after the tokens it was fed; `fill` writes the mask of the tokens that may
come next. Its state is a function of the sequence's *output tokens* and nothing else, so the engine never
has to tell it what happened — before each step it is synced to `seq.output_token_ids`:

    matcher fed [A, B, C]      sequence now [A, B, C, D]   -> accept D              (a decode step)
    matcher fed [A, B, C]      sequence now [A, B, C]      -> nothing               (preempted, recomputed:
                                                                                     the outputs are kept)
    matcher fed [A, B, C, D]   sequence now [A, B, E]      -> roll back 2, accept E (a sequence whose
                                                                                     last tokens were replaced)

The engine never replaces a constrained sequence's tokens today: those requests do not speculate (chapter
14's rejected drafts are the case rollback is for; manager.py says what combining them would take). The
rollback is part of the contract all the same, so a matcher is right for any token history it is handed.

One matcher per completion (n > 1: completion i has its own, fed its own tokens).
"""

import xgrammar as xgr


class GrammarViolation(RuntimeError):
    """The sequence holds a token its grammar refuses (only possible if something bypassed the mask)."""


class SequenceMatcher:
    """xgrammar's GrammarMatcher plus the tokens it has accepted."""

    def __init__(self, grammar: "xgr.CompiledGrammar"):
        self.matcher = xgr.GrammarMatcher(grammar)
        self.tokens: list[int] = []  # accepted so far, in order

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state that after exactly `output_token_ids`: roll back the tokens it holds past
        the longest common prefix, then accept the sequence's tokens after it. Raises GrammarViolation
        (and accepts nothing more) if the grammar refuses one."""
        common = 0
        if output_token_ids[:len(self.tokens)] == self.tokens:  # the usual case: the sequence only grew
            common = len(self.tokens)
        else:
            while common < min(len(self.tokens), len(output_token_ids)) and \
                    self.tokens[common] == output_token_ids[common]:
                common += 1
        if len(self.tokens) > common:
            self.matcher.rollback(len(self.tokens) - common)
            del self.tokens[common:]
        for token_id in output_token_ids[common:]:
            if not self.matcher.accept_token(token_id):
                raise GrammarViolation(f"token {token_id} (output position {len(self.tokens)}) is not allowed "
                                       f"by the grammar")
            self.tokens.append(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Write the next-token mask into bitmask[row] (int32 words, bit j of word w = token 32 w + j)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self.matcher.is_terminated()
