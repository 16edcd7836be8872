"""Chapter 03 — sampling: from the next-token logits to one token id.

    logits (vocab,) --/temperature--> --top-k--> --top-p--> softmax --> draw one id

- temperature T: divide the logits by T before the softmax. T < 1 sharpens the distribution,
  T > 1 flattens it, and T = 0 is *greedy*: always the argmax, no randomness at all.
- top-k: keep the k most likely tokens, set the rest to -inf (k = 0 or -1: off, as in vLLM).
- top-p (nucleus): keep the smallest set of most likely tokens whose probabilities sum to at
  least p, so the cut adapts to how confident the model is (p = 1: off).

Worked example, logits [2, 1, 0, -1] at T = 1: probs [.644, .237, .087, .032].
top_k = 2 keeps [.731, .269, 0, 0] (renormalised); top_p = 0.9 keeps the first three
(.644 + .237 = .881 < .9, adding .087 reaches .968) -> [.665, .245, .090, 0].

Every request draws from its *own* `torch.Generator` when it has a seed, so its tokens do not
depend on which other requests share the batch or in which order they are sampled.
"""

from dataclasses import dataclass, replace

import torch

from nanoserve.structured.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request (the names and defaults of vLLM's SamplingParams).

    temperature: 0 = greedy; top_k: 0 or -1 = off; top_p: 1.0 = off; seed: None = the global RNG;
    max_tokens: most new tokens; stop: strings that end the output (the text is cut before them);
    stop_token_ids: ids that end the output; ignore_eos: keep going past the EOS token;
    n: completions of the same prompt (parallel sampling: the prompt is computed once, chapter 06);
    structured: the grammar the output must follow (chapter 13: JSON schema, regex, choice), None = free text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    structured: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or self.top_k >= 1):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            raise ValueError(f"structured must be a StructuredOutputsParams or None, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_completion(self, index: int) -> "SamplingParams":
        """Completion `index` of n: one completion, seed + index, so completion i of a seeded request
        draws exactly what the same prompt with seed + i would draw alone."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private random stream for a seeded request; None (the global RNG) otherwise."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits, set the others to -inf. (vocab,) -> (vocab,)"""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k).values[-1]
    # ties with the k-th value are kept, so a few more than k may survive
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p. (vocab,) -> (vocab,)"""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
    remove_sorted = mass_before >= top_p  # the set already reached top_p without it (never the first)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: temperature, then top-k, then top-p. (vocab,) -> (vocab,)"""
    if params.greedy:
        raise ValueError("temperature 0 is greedy: there is no distribution to sample from")
    logits = logits.float() / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from next-token `logits` (vocab,)."""
    if logits.dim() != 1:
        raise ValueError(f"sample takes logits of shape (vocab,), got {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def sample_batch(logits: torch.Tensor, params_list: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of `logits` (B, vocab); row i uses params_list[i] and generators[i], so a
    seeded request draws the same tokens whatever else is in the batch."""
    if not logits.shape[0] == len(params_list) == len(generators):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(params_list)} params and {len(generators)} generators")
    return [sample(row, p, g) for row, p, g in zip(logits, params_list, generators)]
