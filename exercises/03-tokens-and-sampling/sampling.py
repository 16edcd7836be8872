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
    raise NotImplementedError("Exercise 3.1: write top_k_filter")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Exercise 3.1. Nucleus filter: keep the smallest set of most likely tokens whose
    probabilities (softmax of `logits`) sum to at least `top_p`; -inf for the others. (vocab,) -> (vocab,)

    A token is kept when the probability of all tokens ranked above it is still below top_p, so the
    most likely token is always kept. top_p = 1.0 means "off": return `logits` unchanged.
    The result must not depend on the order of the tokens in `logits` (tokens of exactly equal logits aside:
    where the cut falls inside such a tie, which of them stays may depend on their positions).

    >>> top_p_filter(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0.9)   # probs .644 .237 .087 .032
    tensor([2., 1., 0., -inf])
    """
    raise NotImplementedError("Exercise 3.1: write top_p_filter")


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Exercise 3.1. The distribution that `sample` draws from, (vocab,) -> (vocab,), summing to 1: the softmax of
    logits / params.temperature over the tokens that params.top_k keeps and, of those, params.top_p keeps (both judged
    on the tempered logits, top-p on the renormalised survivors of top-k); 0 for every other token.
    A ValueError for temperature 0 (greedy: there is no distribution to draw from).
    (params.min_p is chapter 08's, not this exercise's: the engine applies it before your sampler sees the logits.)

    >>> probabilities(torch.tensor([2.0, 1.0, 0.0, -1.0]), SamplingParams(top_k=2))
    tensor([0.7311, 0.2689, 0.0000, 0.0000])
    >>> probabilities(torch.tensor([2.0, 1.0, 0.0, -1.0]), SamplingParams(top_p=0.9))   # .644 + .237 < .9
    tensor([0.6652, 0.2447, 0.0900, 0.0000])
    """
    raise NotImplementedError("Exercise 3.1: write probabilities")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Exercise 3.1. One token id (an int) from next-token `logits` (vocab,).

    Greedy (params.temperature == 0): the most likely token, with no randomness. Otherwise a random token,
    token t with probability probabilities(logits, params)[t] (a filtered-out token is never drawn), whose
    randomness comes from `generator` alone (None: torch's global RNG): two generators seeded alike give the
    same sequence of tokens, whatever else uses the global RNG in between.
    A ValueError if logits is not 1-D.

    >>> sample(torch.tensor([0.1, 3.0, -2.0]), SamplingParams(temperature=0))
    1
    """
    raise NotImplementedError("Exercise 3.1: write sample")


def sample_batch(logits: torch.Tensor, params_list: list[SamplingParams], generators: list) -> list[int]:
    """Exercise 3.1. One token id per row of `logits` (B, vocab) -> a list of B ints: row i drawn as `sample`
    draws it with params_list[i] and generators[i]. Row i's token depends on row i, its params and its generator
    only — not on the other rows, how many there are or their order — so a seeded request draws the same tokens
    alone or in any batch. The engine (chapter 06) hands you each sequence's rows this way.
    A ValueError if logits' rows, params_list and generators are not all the same length.

    >>> sample_batch(torch.tensor([[0.0, 5.0], [5.0, 0.0]]), [SamplingParams(temperature=0)] * 2, [None, None])
    [1, 0]
    """
    raise NotImplementedError("Exercise 3.1: write sample_batch")
