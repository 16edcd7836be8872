"""Chapter 08 — the batched sampler: one step's logits rows and each row's own request -> tokens (+ logprobs).

    logits (num_sampled, vocab)  float32, straight from the LM head
    rows   one SampleRow per token to draw: which logits row, the request's params, generator and tokens

    per row:  raw logits ──logprobs?──▶ log_softmax: the token's and the top-k  ("raw logprobs", as vLLM's default)
                 │
                 └──▶ logit_bias, repetition / frequency / presence penalties, min-p (nanoserve/sampling.py)
    the rows, stacked (num_rows, vocab) ──▶ chapter 03's sample_batch: row i greedy, or temperature, top-k, top-p
                                            and one draw with row i's own generator

Everything is per row: a request's penalties read only its own prompt and output tokens, its draw uses
only its own generator, so what it gets does not depend on who else is in the batch. Several rows may
read the same logits row (a prompt with n > 1 draws its n first tokens from its one row, chapter 06).
The draw is chapter 03's `sample_batch`, from the module the engine was given: the learner's under
`--student 03`. Chapter 03's sampler knows nothing of min-p (chapter 08's addition), so min-p is applied
here, at the request's temperature, and the row goes on with min_p = 0: exactly what
nanoserve.sampling.probabilities would draw from with it.

The logprobs are those of the model's distribution, before any penalty, temperature or filter: vLLM's
default (`logprobs_mode="raw_logprobs"`; "processed_logprobs" would be after them). A client that asks for
them learns how likely the model found each token, not how likely this request's sampler made it. The one
change the distribution does see is chapter 13's grammar mask, applied to the logits before this sampler
reads them (in vLLM too): under a response_format the logprobs are the model's over the tokens the grammar
allows, renormalized, so a forced "{" reads log p = 0. A forbidden token has probability 0 (log p = -inf):
it is left out of the top alternatives — OpenAI's top_logprobs "may be fewer than requested" — so no -inf
ever reaches a response.
"""

from dataclasses import dataclass, replace
from types import ModuleType

import torch

import nanoserve.sampling as reference_sampling
from nanoserve.sampling import SamplingParams, apply_penalties, min_p_filter


@dataclass
class TokenLogprob:
    """One position's log probabilities: the token that is there, and the `top` most likely alternatives.

    token_id, logprob: the sampled (or, for a prompt, the given) token and log p(token);
    rank: 1 for the most likely token; top: [(token id, logprob)], most likely first (len = the request's k).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SampleRow:
    """One token to draw: from logits row `row`, for a request with these params and tokens so far."""

    row: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """The TokenLogprob of token_ids[i] under the log-probabilities row i of `logprobs` (len(token_ids), vocab).

        >>> lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]]), -1)
        >>> token_logprobs(lp, [1], 1)[0].rank, round(token_logprobs(lp, [1], 1)[0].logprob, 3)
        (2, -1.408)
    """
    ids = torch.tensor(token_ids, dtype=torch.long)
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # (n,)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1  # ties rank as the best of them
    top = torch.topk(logprobs, k, dim=-1) if k else None
    out = []
    for i, t in enumerate(token_ids):
        # a token the grammar masked has probability 0: not an alternative (and -inf is not JSON)
        alternatives = [(a, lp) for a, lp in zip(top.indices[i].tolist(), top.values[i].tolist())
                        if lp != float("-inf")] if k else []
        out.append(TokenLogprob(t, float(chosen[i]), int(ranks[i]), alternatives))
    return out


def sample_rows(logits: torch.Tensor, rows: list[SampleRow],
                sampling: ModuleType = reference_sampling) -> tuple[list[int], list[TokenLogprob | None]]:
    """(token per row, its TokenLogprob or None where the request did not ask for logprobs). sampling: the module
    whose sample_batch draws (chapter 03's; the learner's under --student 03)."""
    logits = logits.float()
    ready, params = [], []
    for r in rows:
        row, p = apply_penalties(logits[r.row], r.params, r.prompt_token_ids, r.output_token_ids), r.params
        if p.min_p and not p.greedy:  # the tokens min-p drops at this temperature become -inf, and stay so
            row = row.masked_fill(min_p_filter(row / p.temperature, p.min_p) == float("-inf"), float("-inf"))
            p = replace(p, min_p=0.0)
        ready.append(row)
        params.append(p)
    tokens = sampling.sample_batch(torch.stack(ready), params, [r.generator for r in rows])  # (num_rows, vocab) -> ids
    logprobs = [None if r.params.logprobs is None else
                token_logprobs(torch.log_softmax(logits[r.row], -1)[None], [token], r.params.logprobs)[0]
                for r, token in zip(rows, tokens)]
    return tokens, logprobs
