"""Chapter 14 — which proposed tokens to keep.

The target scored the sequence's last token and its k proposals d_1..d_k in one pass: k + 1 rows of
logits, row i the target's next-token distribution p_i after d_1..d_i (row 0: after the last real token).

Greedy (temperature 0): accept d_i while it equals argmax p_{i-1}; at the first mismatch emit the
target's argmax instead; if all k match, row k gives one more token (the bonus). The output is exactly
what k + 1 plain greedy steps would have produced.

    proposal [7, 8, 9], target argmax per row [7, 8, 4, 2]  -> accept 7, 8; reject 9; emit 4 -> [7, 8, 4]
    proposal [7, 8],    target argmax per row [7, 8, 5]     -> all accepted, bonus 5          -> [7, 8, 5]

Sampling (Leviathan et al. 2023, Chen et al. 2023): the proposal d_i was drawn from q_i. Accept it with
probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection draw from the residual
max(0, p_i - q_i) / sum(max(0, p_i - q_i)) and stop; if all are accepted, draw the bonus from p_k.
Why it is exact, for one position: the token x comes out either accepted or from the residual,

    P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * max(0, p(x) - q(x)) / Z
         = min(q(x), p(x))       + Z * max(0, p(x) - q(x)) / Z          with Z = sum_y max(0, p(y) - q(y))
         = p(x)                                                          (1 - sum min(q, p) = Z)

A deterministic proposer (n-gram, a greedy draft) has q one-hot at d: accept with probability p(d); on
rejection the residual is p with d removed, renormalised.
"""

import torch


def greedy_accept(proposal: list[int], target_argmax: list[int]) -> list[int]:
    """The new tokens of a greedy sequence: the accepted prefix of `proposal`, then the target's own token.

    proposal: k tokens; target_argmax: k + 1 ids, the argmax of each verified row. Returns 1..k+1 tokens.

    >>> greedy_accept([7, 8, 9], [7, 8, 4, 2])
    [7, 8, 4]
    """
    if len(target_argmax) != len(proposal) + 1:
        raise ValueError(f"{len(proposal)} proposals need {len(proposal) + 1} target rows, got {len(target_argmax)}")
    out = []
    for d, t in zip(proposal, target_argmax):
        if d != t:
            break
        out.append(d)
    out.append(target_argmax[len(out)])  # the correction at the first mismatch, or the bonus
    return out


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) normalised: what to draw from after a rejection. (vocab,) -> (vocab,)
    If p <= q everywhere (only when p == q, up to rounding) nothing is left: fall back to p."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def rejection_sample(proposal: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The new tokens of a sampled sequence, distributed exactly as tokens sampled from the target one by one.

    proposal: k tokens; target_probs: (k + 1, vocab), row i the target's distribution for position i;
    draft_probs: (k, vocab), the distribution each proposal was drawn from (None: one-hot, a deterministic
    proposer). Returns the accepted proposals, then one token from the residual (first rejection) or from
    the last row (the bonus).
    """
    k = len(proposal)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} target rows, got {target_probs.shape[0]}")
    if draft_probs is None:
        draft_probs = torch.zeros(k, target_probs.shape[1], dtype=target_probs.dtype)
        draft_probs[torch.arange(k), torch.tensor(proposal, dtype=torch.long)] = 1.0
    out = []
    for i, d in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator)
        if u * q[d] < p[d]:  # u < p/q without dividing by a zero q
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual(p, q), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))  # all accepted: the bonus
    return out
