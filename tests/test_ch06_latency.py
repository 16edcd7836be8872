"""Chapter 06 — the latency sweep behind `bench experiment prefill-budget` (budget_sweep), on a tiny random model:
every running stream's gaps are recorded step by step, the long prompts get a TTFT, and each configuration really
reaches the engine (chunking off refuses a prompt larger than the step budget up front). Timings themselves are
measured by the benchmark, never asserted here."""

import argparse

import numpy
import pytest
import torch

from nanoserve.bench import experiment
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


@pytest.fixture
def rounds_run(monkeypatch):
    """Every interleaved(...) call budget_sweep makes, with what it measured: [{name: [result per round]}]."""
    calls, real = [], experiment.interleaved

    def spy(rounds, systems, measure, first=0):
        calls.append(real(rounds, systems, measure, first))
        return calls[-1]

    monkeypatch.setattr(experiment, "interleaved", spy)
    return calls


def test_the_warm_up_round_is_not_in_the_results(tiny, rounds_run, capsys):
    # warmup=True: one untimed round of every budget, then the timed round(s); with one timed round, what the sweep
    # returns for a budget is that round's result itself, never the warm-up's
    budgets = {"chunked, 80": (True, 80), "off, 128": (False, 128)}
    best = budget_sweep(tiny, budgets, num_streams=2, stream_output=4, long_len=100, long_arrivals=(2,), long_output=2,
                        rounds=1, warmup=True)
    assert [{name: len(runs) for name, runs in call.items()} for call in rounds_run] == [{"chunked, 80": 1, "off, 128": 1}] * 2
    warm, timed = rounds_run
    for name in budgets:
        assert best[name] is timed[name][0] and best[name] is not warm[name][0], name
    assert capsys.readouterr().err.splitlines() == ["  warm-up, untimed:", "  round 1 chunked, 80: done",
                                                    "  round 1 off, 128: done", "  round 1 chunked, 80: done",
                                                    "  round 1 off, 128: done"]
    budget_sweep(tiny, budgets, num_streams=2, stream_output=4, long_len=100, long_arrivals=(2,), long_output=2, rounds=1)
    assert len(rounds_run) == 3  # without warmup: the timed round alone


def test_prefill_budget_warms_up_before_its_rounds(tiny, rounds_run, monkeypatch, capsys):
    # the command's sweep, its workload cut down to the tiny model's size (the full one is 1024-token prompts), keeps
    # what the command asks for: its budgets, its rounds and the warm-up
    asked, real = [], experiment.budget_sweep

    def small(model, budgets, **kwargs):
        asked.append(kwargs)
        return real(model, budgets, **{**kwargs, "num_streams": 2, "long_len": 100, "long_arrivals": (2,), "long_output": 2})

    monkeypatch.setattr(experiment, "budget_sweep", small)
    result, _ = experiment.prefill_budget(argparse.Namespace(output_len=4, rounds=1), tiny, None)
    assert asked == [{"stream_output": 4, "rounds": 1, "warmup": True}]
    warm, timed = rounds_run
    assert list(warm) == list(timed) == list(result["best"]) == list(experiment.BUDGETS)
    assert all(result["best"][name] is timed[name][0] is not warm[name][0] for name in experiment.BUDGETS)
    assert "least disturbed of 1 interleaved round(s) after an untimed warm-up round" in capsys.readouterr().out
