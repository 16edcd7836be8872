"""Chapter 14 — when to speculate.

A step that verifies k proposals costs 1 + k·c plain decode steps and emits E = (1 - α^(k+1)) / (1 - α) tokens
(chapter 14, section 5): speculation pays only while α > c. At batch 1 on a GPU a decode step reads every
weight for one token, c is near 0 and any accepted proposal is profit. As the batch grows the step turns
compute-bound (chapter 09's roofline) and c grows: the k rows of every sequence become real work that delays
everyone. So speculation turns off once the running batch reaches `disable_by_batch_size` (vLLM's
`speculative_disable_by_batch_size`). A request can opt out alone (add_request(..., speculative=False)).
"""

from dataclasses import dataclass

# Speculate only while a sequence runs alone. Provisional, and not backed by a measured win: in chapter 14's
# section 7 (`python -m nanoserve bench spec --prompts 1 --max-tokens 24 -k 2 4 --proposers ngram draft --load 1 4
# --rounds 1 --threads 1`: one prompt of each kind, one round, a 2-core CPU at load ~25) n-gram won nowhere:
# 0.96x-0.98x on a grounded prompt and 0.82x on a chat prompt at batch 1, 0.59x with 1 and 0.85x with 4 grounded
# requests at once. Batch 1 is where the extra rows cost least, so where a win would show first.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass
class SpecDecodeStats:
    """Counters in vLLM's names: proposals verified, proposed tokens, of them accepted; and the proposals
    cut short by a rejection (the rest had every token accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """The chance that a proposed token is accepted, given every one before it was: each token the rule
        tested was accepted or was the one rejection of its proposal (tokens after a rejection are never
        tested, so accepted / proposed underestimates it). The α of E = (1 - α^(k+1)) / (1 - α)."""
        tested = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / tested if tested else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step emits on average: accepted proposals + the correction/bonus."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def num_speculative_tokens(k: int, batch_size: int, disable_by_batch_size: int | None) -> int:
    """How many tokens to propose per sequence this step: k, or 0 once the batch is too large.

    >>> num_speculative_tokens(4, 1, 4), num_speculative_tokens(4, 4, 4), num_speculative_tokens(4, 9, None)
    (4, 0, 4)
    """
    if disable_by_batch_size is not None and batch_size >= disable_by_batch_size:
        return 0
    return k
