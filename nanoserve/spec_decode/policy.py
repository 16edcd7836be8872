"""Chapter 14 — when to speculate.

A step that verifies k proposals costs 1 + k·c plain decode steps and emits E = (1 - α^(k+1)) / (1 - α) tokens
(chapter 14, section 5): speculation pays only while α > c. At batch 1 on a GPU a decode step reads every
weight for one token, c is near 0 and any accepted proposal is profit. As the batch grows the step turns
compute-bound (chapter 09's roofline) and c grows: the k rows of every sequence become real work that delays
everyone. So speculation turns off once the running batch reaches `disable_by_batch_size` (vLLM's
`speculative_disable_by_batch_size`). A request can opt out alone (add_request(..., speculative=False)).
"""

from dataclasses import dataclass

# Speculate only while a sequence runs alone. Chapter 14's section 7 (`python -m nanoserve bench spec --threads 1`,
# on a reserved core): n-gram won at batch 1 on the 3 grounded prompts, 1.09x-1.16x at k = 2 and 4 (one pass per
# prompt), and lost on another grounded prompt alone (0.90x, load N = 1) and with 4 and 16 grounded requests at
# once (0.69x, 0.86x). Batch 1 is where the extra rows cost least; N = 2 and 3 were not measured.
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
