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

Before all that the server's penalties change the raw logits of one row (chapter 08, `apply_penalties`),
in vLLM's order: logit_bias, then repetition, frequency and presence penalties, then temperature, then
min-p (`min_p_filter`), then top-k and top-p.
"""

from dataclasses import dataclass, replace

import torch

from nanoserve.structured.params import StructuredOutputsParams


# The bounds that keep one request's numbers finite inside a step (a NaN there would fail the whole batch's draw):
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed: OpenAI's bound (the server's edge)
GENERATOR_SEED_MAX = 2**64 - 1  # torch.Generator's: room above SEED_MAX for completion i's seed + i (n > 1)
MIN_TEMPERATURE = 0.01  # vLLM's floor for a temperature > 0: logits / 1e-300 are inf, their softmax NaN
MIN_REPETITION_PENALTY = 0.01  # a positive logit / 1e-300 is inf too


@dataclass
class SamplingParams:
    """How to pick tokens for one request (the names and defaults of vLLM's SamplingParams).

    temperature: 0 = greedy (below MIN_TEMPERATURE, vLLM's floor, it is raised to it: 1 / 1e-300 overflows);
    top_k: 0 or -1 = off; top_p: 1.0 = off; seed: None = the global RNG, else an int a torch.Generator takes (with
    room for seed + i, n > 1; a seed past it would fail the step it is drawn in; the server takes OpenAI's int64);
    max_tokens: most new tokens; stop: strings that end the output (the text is cut before them);
    stop_token_ids: ids that end the output; ignore_eos: keep going past the EOS token;
    n: completions of the same prompt (parallel sampling: the prompt is computed once, chapter 06).

    Chapter 08 (the OpenAI API): presence_penalty / frequency_penalty in [-2, 2] (0: off), over the
    generated tokens; repetition_penalty > 0 (1: off), over prompt and generated tokens; logit_bias:
    {token id: bias in [-100, 100]} added to the logits; min_p in [0, 1] (0: off); logprobs: the top
    logprobs to return per generated token (None: none; 0: only the sampled token's); prompt_logprobs:
    the same for every prompt token (None: not computed).
    Chapter 13: structured: the grammar the output must follow (JSON schema, regex, choice), None = free text.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_number(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or self.top_k >= 1):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= GENERATOR_SEED_MAX - self.n):
            raise ValueError(f"seed must be an int in [-2**63, 2**64 - 1 - n] or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {getattr(self, name)!r}")
        if not _is_number(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1e4:
            raise ValueError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 1e4], "
                             f"got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        self.logit_bias = dict(self.logit_bias or {})
        if not all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            raise ValueError(f"structured must be a StructuredOutputsParams or None, got {self.structured!r}")
        for name in ("stop", "stop_token_ids"):  # chapter 13: the grammar alone decides where its output ends
            if self.structured is not None and getattr(self, name):
                raise ValueError(f"{name} cannot be combined with structured outputs (response_format, "
                                 "structured_outputs, tools): it would cut the output before its grammar is complete")

    @property
    def penalized(self) -> bool:
        """Does anything change this request's raw logits before temperature? (if not, skip the work)"""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_completion(self, index: int) -> "SamplingParams":
        """Completion `index` of n: one completion, seed + index, so completion i of a seeded request
        draws exactly what the same prompt with seed + i would draw alone."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> torch.Tensor:
    """One request's row of raw logits (vocab,) after logit_bias and the three penalties -> (vocab,).

    logit_bias:          logits[t] += bias[t]                                 (-100 in effect bans t)
    repetition_penalty:  for every t in prompt or output: logits[t] / r if logits[t] > 0 else logits[t] * r
                         (HF's and vLLM's definition: r > 1 makes a seen token less likely either way)
    frequency_penalty:   logits[t] -= f * (times t was generated)             (OpenAI's definition)
    presence_penalty:    logits[t] -= p * (1 if t was generated at all)

    Worked example: logits [2, -1, 0.5], prompt [1], output [0, 0]; repetition 2, frequency 0.5, presence 1:
    token 0 (generated twice): 2 / 2 - 0.5 * 2 - 1 = -1;  token 1 (in the prompt): -1 * 2 = -2;  token 2: 0.5.

        >>> apply_penalties(torch.tensor([2.0, -1.0, 0.5]), SamplingParams(repetition_penalty=2,
        ...                 frequency_penalty=0.5, presence_penalty=1), [1], [0, 0])
        tensor([-1.0000, -2.0000,  0.5000])
    """
    if not params.penalized:
        return logits
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
    if params.repetition_penalty != 1 and (prompt_token_ids or output_token_ids):
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long)
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(output_token_ids, dtype=torch.long), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the most likely token's. (vocab,) -> (vocab,)

    Logits [2, 1, 0, -1] (probs .644 .237 .087 .032), min_p 0.2: the cut is .129, so the last two go.

        >>> min_p_filter(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0.2)
        tensor([2., 1., -inf, -inf])
    """
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: temperature, (min-p,) then top-k, then top-p. (vocab,) -> (vocab,)"""
    if params.greedy:
        raise ValueError("temperature 0 is greedy: there is no distribution to sample from")
    logits = logits.float() / params.temperature
    logits = min_p_filter(logits, params.min_p)  # chapter 08 (vLLM's extension, its place in vLLM's order); 0: off
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
    seeded request draws the same tokens whatever else is in the batch, and in whatever order. The engine's
    sampler (nanoserve/engine/sampler.py) calls it with each sequence's rows, after their penalties and min-p."""
    if not logits.shape[0] == len(params_list) == len(generators):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(params_list)} params and {len(generators)} generators")
    return [sample(row, p, g) for row, p, g in zip(logits, params_list, generators)]
