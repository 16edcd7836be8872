"""Exercise 03 (3.1) — top-k / top-p filtering and sampling.

Your version of nanoserve/sampling.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=03`.
`SamplingParams` and `make_generator` are given (imported from nanoserve); you write the rest.
"""

import torch

from nanoserve.sampling import SamplingParams, make_generator  # noqa: F401  (given: part of the same API)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Exercise 3.1. Keep the `top_k` largest logits, set the others to -inf. (vocab,) -> (vocab,)

    top_k = 0 or -1 means "off", and a top_k at least the vocabulary size keeps everything:
    return `logits` unchanged. Ties with the k-th largest value may be kept.

    >>> top_k_filter(torch.tensor([0.5, 3.0, -1.0, 2.0]), 2)
    tensor([-inf, 3., -inf, 2.])
    """
    raise NotImplementedError("Exercise 3.1: keep the k largest logits, -inf for the rest")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Exercise 3.1. Nucleus filter: keep the smallest set of most likely tokens whose
    probabilities (softmax of `logits`) sum to at least `top_p`; -inf for the others. (vocab,) -> (vocab,)

    A token is kept when the probability of all tokens ranked above it is still below top_p, so the
    most likely token is always kept. top_p = 1.0 means "off": return `logits` unchanged.
    The result must not depend on the order of the tokens in `logits`.

    >>> top_p_filter(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0.9)   # probs .644 .237 .087 .032
    tensor([2., 1., 0., -inf])
    """
    raise NotImplementedError("Exercise 3.1: sort, cumulative sum of probabilities, mask the tail, unsort")


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Exercise 3.1. The distribution that `sample` draws from, (vocab,) -> (vocab,):
    divide by params.temperature, then top_k_filter, then top_p_filter, then softmax.
    Raise ValueError for temperature 0 (greedy has no distribution)."""
    raise NotImplementedError("Exercise 3.1: temperature, top-k, top-p, softmax — in that order")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Exercise 3.1. One token id from next-token `logits` (vocab,): the argmax when
    params.temperature == 0, else one draw from `probabilities` with torch.multinomial using
    `generator` (None: the global RNG). Raise ValueError if logits is not 1-D."""
    raise NotImplementedError("Exercise 3.1: greedy argmax, or torch.multinomial(..., generator=generator)")


def sample_batch(logits: torch.Tensor, params_list: list[SamplingParams], generators: list) -> list[int]:
    """Exercise 3.1. One token per row of `logits` (B, vocab): row i with params_list[i] and
    generators[i], so a seeded request draws the same tokens whatever shares its batch.
    Raise ValueError if the three lengths differ."""
    raise NotImplementedError("Exercise 3.1: sample each row with its own params and generator")
