"""Chapter 03: SamplingParams, the top-k / top-p filters and the sampler (graded: exercise 3.1).

The expectations are computed by hand from small logits (see the worked example in
nanoserve/sampling.py), and sampled frequencies are compared to them.
"""

import math

import pytest
import torch

from nanoserve.sampling import SamplingParams, make_generator
from nanoserve.student import implementation

sampling = implementation("nanoserve.sampling")

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])
E = [math.exp(x) for x in (2.0, 1.0, 0.0, -1.0)]  # 7.389, 2.718, 1.000, 0.368


def normalised(weights):
    return torch.tensor([w / sum(weights) for w in weights])


# ---------------------------------------------------------------- SamplingParams (not graded)

@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("max_tokens", 0),
     ("max_tokens", 1.5), ("seed", "7"), ("stop", [""]), ("stop_token_ids", [-1])],
)
def test_invalid_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_param_defaults_and_normalisation():
    p = SamplingParams(stop="END")
    assert p.stop == ["END"] and p.stop_token_ids == [] and p.top_k == 0 and p.top_p == 1.0
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(top_k=-1).top_k == -1  # -1, like 0, disables top-k (vLLM's convention)


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    a, b = make_generator(SamplingParams(seed=3)), make_generator(SamplingParams(seed=3))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


# ---------------------------------------------------------------- the filters (exercise 3.1)

@pytest.mark.exercise("3.1")
def test_top_k_filter_keeps_the_k_largest():
    out = sampling.top_k_filter(torch.tensor([0.5, 3.0, -1.0, 2.0]), 2)
    assert torch.equal(out, torch.tensor([float("-inf"), 3.0, float("-inf"), 2.0]))
    assert torch.equal(sampling.top_k_filter(LOGITS, 0), LOGITS)  # 0: off
    assert torch.equal(sampling.top_k_filter(LOGITS, -1), LOGITS)  # -1: off
    assert torch.equal(sampling.top_k_filter(LOGITS, 10), LOGITS)  # more than the vocabulary: all kept


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize(
    "top_p,kept",
    [(0.5, 1),  # .644 alone reaches .5
     (0.7, 2),  # .644 < .7, + .237 = .881
     (0.9, 3),  # .881 < .9, + .087 = .968
     (0.99, 4),  # .968 < .99: the last token is needed too
     (1.0, 4)],
)
def test_top_p_filter_keeps_the_smallest_nucleus(top_p, kept):
    out = sampling.top_p_filter(LOGITS, top_p)
    expected = torch.cat([LOGITS[:kept], torch.full((4 - kept,), float("-inf"))])
    assert torch.equal(out, expected)


@pytest.mark.exercise("3.1")
def test_top_p_filter_does_not_depend_on_token_order():
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(sampling.top_p_filter(LOGITS[perm], 0.9), sampling.top_p_filter(LOGITS, 0.9)[perm])


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(), normalised(E)),
        (SamplingParams(temperature=0.5), normalised([w**2 for w in E])),  # logits / 0.5
        (SamplingParams(temperature=2.0), normalised([math.sqrt(w) for w in E])),
        (SamplingParams(top_k=2), normalised(E[:2] + [0, 0])),
        (SamplingParams(top_p=0.9), normalised(E[:3] + [0])),
        # top-k first, then top-p on the renormalised survivors: [.665, .245, .090] -> .665 < .8, keep 2
        (SamplingParams(top_k=3, top_p=0.8), normalised(E[:2] + [0, 0])),
        # logits / 0.5: softmax [.865, .117, .016, .002] -> .865 < .9, keep 2
        (SamplingParams(temperature=0.5, top_p=0.9), normalised([E[0] ** 2, E[1] ** 2, 0, 0])),
    ],
)
def test_probabilities_match_hand_computed(params, expected):
    assert torch.allclose(sampling.probabilities(LOGITS, params), expected, atol=1e-6)


# ---------------------------------------------------------------- the sampler (exercise 3.1)

@pytest.mark.exercise("3.1")
def test_greedy_is_the_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert sampling.sample(logits, SamplingParams(temperature=0), None) == int(logits.argmax())


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize(
    "params,expected",
    [(SamplingParams(seed=0), normalised(E)),
     (SamplingParams(seed=1, top_k=2), normalised(E[:2] + [0, 0])),
     # T = 2: [.455, .276, .167, .102]; .731 < .85 but .898 >= .85
     (SamplingParams(seed=2, temperature=2.0, top_p=0.85), normalised([math.sqrt(w) for w in E[:3]] + [0]))],
)
def test_sampled_frequencies_match_the_distribution(params, expected):
    n = 8000
    g = make_generator(params)
    counts = torch.bincount(torch.tensor([sampling.sample(LOGITS, params, g) for _ in range(n)]), minlength=4)
    # binomial std is at most sqrt(.25 / 8000) = .0056; the seed makes this deterministic anyway
    assert torch.allclose(counts / n, expected, atol=0.02)
    assert all(counts[expected == 0] == 0)  # filtered tokens are never drawn


@pytest.mark.exercise("3.1")
def test_a_seed_gives_the_same_tokens():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(seed=123, temperature=1.5)

    def draw():
        g = make_generator(params)
        return [sampling.sample(logits, params, g) for _ in range(20)]

    first = draw()
    torch.rand(10)  # using the global RNG in between changes nothing
    assert draw() == first and len(set(first)) > 1


@pytest.mark.exercise("3.1")
def test_batch_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    seeded, other = SamplingParams(seed=7), SamplingParams(seed=8, temperature=0.8)

    g = make_generator(seeded)
    alone = [sampling.sample_batch(logits[1:2], [seeded], [g])[0] for _ in range(10)]
    g, g_other = make_generator(seeded), make_generator(other)
    params = [other, seeded, SamplingParams(temperature=0)]
    in_batch = [sampling.sample_batch(logits, params, [g_other, g, None])[1] for _ in range(10)]
    assert alone == in_batch and len(set(alone)) > 1
    assert sampling.sample_batch(logits, [SamplingParams(temperature=0)] * 3, [None] * 3) == logits.argmax(-1).tolist()


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3]])
def test_a_seeded_row_draws_the_same_in_any_order(order):
    """Ten steps of a batch whose rows are the requests in `order`: each request draws exactly what it draws in a
    batch of its own, wherever its row is and whoever shares the batch."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(seed=7), SamplingParams(seed=8, temperature=0.8, top_k=20), SamplingParams(temperature=0),
              SamplingParams(seed=9, top_p=0.9)]

    def draws(rows: list[int]) -> dict[int, list[int]]:
        generators = {i: make_generator(params[i]) for i in rows}
        out = {i: [] for i in rows}
        for _ in range(10):
            tokens = sampling.sample_batch(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
            for i, token in zip(rows, tokens):
                out[i].append(token)
        return out

    together = draws(order)
    for i in order:
        assert together[i] == draws([i])[i]
    assert all(len(set(together[i])) > 1 for i in order if not params[i].greedy)  # the seeded rows really draw


# ---------------------------------------------------------------- the stated errors (exercise 3.1)

@pytest.mark.exercise("3.1")
def test_probabilities_refuses_temperature_0():
    with pytest.raises(ValueError):
        sampling.probabilities(LOGITS, SamplingParams(temperature=0))  # greedy has no distribution


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("shape", [(1, 4), (2, 4), ()])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_sample_refuses_logits_that_are_not_1d(shape, temperature):
    with pytest.raises(ValueError):
        sampling.sample(torch.zeros(shape), SamplingParams(temperature=temperature), None)


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("rows, params, generators", [(2, 1, 2), (2, 2, 1), (1, 2, 2), (3, 2, 3)])
def test_sample_batch_refuses_lengths_that_differ(rows, params, generators):
    with pytest.raises(ValueError):
        sampling.sample_batch(torch.zeros(rows, 4), [SamplingParams()] * params, [None] * generators)
