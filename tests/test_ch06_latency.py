"""Chapter 06 — the latency sweep behind `bench experiment prefill-budget` (budget_sweep), on a tiny random model:
every running stream's gaps are recorded step by step, the long prompts get a TTFT, and each configuration really
reaches the engine (chunking off refuses a prompt larger than the step budget up front). Timings themselves are
measured by the benchmark, never asserted here."""

import numpy
import pytest
import torch

from nanoserve.bench.experiment import budget_sweep
from nanoserve.model import Llama, LlamaConfig


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


def test_gaps_of_every_stream_step_by_step(tiny):
    # 2 streams (32-token prompts) of 10 tokens: prefilled in step 0, then one token per step in steps 1..9, whatever
    # the budget, while a 100-token prompt arrives before step 2 (chunked: 78 tokens beside 2 decodes, then 22)
    best = budget_sweep(tiny, {"chunked, 80": (True, 80), "off, 128": (False, 128)}, num_streams=2, stream_output=10,
                        long_len=100, long_arrivals=(2,), long_output=2, rounds=1)
    for name, x in best.items():
        assert sorted(step for step, _ in x["gaps"]) == [s for s in range(1, 10) for _ in range(2)], name
        assert x["steps"] == 10 and x["long_arrival_steps"] == [2]
        # the summary is of those gaps (numpy's percentiles), and the one long prompt has a TTFT
        gaps = [g for _, g in x["gaps"]]
        assert x["itl_ms"]["median"] == pytest.approx(numpy.median(gaps))
        assert x["itl_ms"]["p99"] == pytest.approx(numpy.percentile(gaps, 99))
        assert x["max_itl_ms"] == max(gaps) and x["ttft_ms"]["median"] == x["ttft_ms"]["p99"] > 0
    # the counts, by hand: step 0 prefills both streams (64 tokens); from step 2 on, 2 decodes beside the long prompt:
    # chunked, 78 of it (80) then 22 (24), first token 2 steps after it arrived; not chunked, all 100 (102), 1 step
    assert (best["chunked, 80"]["max_step_tokens"], best["chunked, 80"]["long_ttft_steps"]) == (80, [2])
    assert (best["off, 128"]["max_step_tokens"], best["off, 128"]["long_ttft_steps"]) == (102, [1])


def test_chunking_off_refuses_a_prompt_larger_than_the_budget(tiny):
    with pytest.raises(ValueError, match="chunked prefill is off"):
        budget_sweep(tiny, {"off, 64": (False, 64)}, num_streams=1, stream_output=4, long_len=100,
                     long_arrivals=(1,), long_output=2, rounds=1)
