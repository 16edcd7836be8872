"""Exercises 14.2 and 14.3 — which proposed tokens to keep: greedy acceptance, and rejection sampling.

Your version of nanoserve/spec_decode/acceptance.py: same functions. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=14 EX=14.2` (or 14.3).
Each rung is graded alone: the reference stands in for the other.
"""

import torch


def greedy_accept(proposal: list[int], target_argmax: list[int]) -> list[int]:
    """Exercise 14.2. The new tokens of a greedy sequence after verifying `proposal`.

    proposal: k proposed tokens d_1..d_k; target_argmax: k + 1 ids, the argmax of each verified row (row i:
    the target's choice after d_1..d_i; row 0: after the last real token). Raise ValueError if the lengths do
    not fit. Returns 1..k+1 tokens: exactly what k + 1 plain greedy steps would emit, as far as the proposal
    is right, then the target's own token (the correction, or after k accepted the bonus).

        greedy_accept([7, 8, 9], [7, 8, 4, 2]) -> [7, 8, 4]
        greedy_accept([7, 8], [7, 8, 5])       -> [7, 8, 5]
    """
    raise NotImplementedError("Exercise 14.2: accept while the proposal matches the target's argmax")


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exercise 14.3. The distribution to draw from after a rejection: max(0, p - q), normalised.
    p, q: (vocab,) probabilities -> (vocab,). If nothing is left (p == q), return p."""
    raise NotImplementedError("Exercise 14.3: the residual distribution")


def rejection_sample(proposal: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Exercise 14.3. The new tokens of a sampled sequence, distributed exactly as if each were sampled from
    the target one step at a time (Leviathan et al. 2023, Chen et al. 2023).

    proposal: k tokens; target_probs: (k + 1, vocab), row i the target's distribution p_i at position i;
    draft_probs: (k, vocab), the q_i each proposal was drawn from, or None for a deterministic proposer
    (q one-hot at the proposed token). Raise ValueError if target_probs has not k + 1 rows. Draw every
    random number from `generator` (torch.rand, torch.multinomial), so a seeded request reproduces.
    Returns the accepted proposals, then one more token: from the residual at the first rejection, or
    from the last row of target_probs (the bonus) if all k were accepted.
    """
    raise NotImplementedError("Exercise 14.3: accept with probability min(1, p/q), else draw from the residual")
