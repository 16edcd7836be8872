"""Chapter 09 — the metric definitions (nanoserve/metrics.py) against timestamps worked out by hand.

Graded: 9.1 one request's TTFT / ITL / E2E / TPOT, 9.2 percentiles, 9.3 goodput and the run summary.
`make grade CH=09` runs them against exercises/09-measuring/metrics.py.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.sequence import Sequence
from nanoserve.student import implementation


def m():
    return implementation("nanoserve.metrics")


# one request: sent at 10.0; chunks at 10.5, 10.6, 10.8, 11.2; last byte at 11.25; 5 tokens (one chunk held 2)
START, CHUNKS, END, TOKENS = 10.0, [10.5, 10.6, 10.8, 11.2], 11.25, 5


@pytest.mark.exercise("9.1")
def test_one_request_by_hand():
    mod = m()
    assert mod.ttft(START, CHUNKS) == pytest.approx(0.5)
    assert mod.itl(CHUNKS) == pytest.approx([0.1, 0.2, 0.4])
    assert mod.e2e(START, END) == pytest.approx(1.25)
    # (1.25 - 0.5) / (5 - 1): divided by tokens from `usage`, not by the 4 chunks
    assert mod.tpot(0.5, 1.25, TOKENS) == pytest.approx(0.1875)
    lat = mod.request_latencies(mod.RequestRecord(START, CHUNKS, END, prompt_tokens=7, output_tokens=TOKENS))
    assert lat["ttft"] == pytest.approx(0.5) and lat["e2e"] == pytest.approx(1.25)
    assert lat["tpot"] == pytest.approx(0.1875) and lat["itl"] == pytest.approx([0.1, 0.2, 0.4])


@pytest.mark.exercise("9.1")
def test_one_request_corner_cases():
    mod = m()
    # one output token: a TTFT and an E2E, but nothing after the first token
    one = mod.request_latencies(mod.RequestRecord(0.0, [0.3], 0.35, output_tokens=1))
    assert one["ttft"] == pytest.approx(0.3) and one["e2e"] == pytest.approx(0.35)
    assert one["tpot"] is None and one["itl"] == []
    # no token at all (say max_tokens hit an immediate EOS): only E2E
    none = mod.request_latencies(mod.RequestRecord(0.0, [], 0.2, output_tokens=0))
    assert none == {"ttft": None, "tpot": None, "itl": [], "e2e": pytest.approx(0.2)}
    # a failed request has no latencies, whatever its timestamps say
    failed = mod.request_latencies(mod.RequestRecord(0.0, [0.1, 0.2], 0.3, output_tokens=2, success=False, error="500"))
    assert failed == {"ttft": None, "tpot": None, "itl": [], "e2e": None}
    assert mod.tpot(None, 1.0, 5) is None and mod.tpot(0.5, None, 5) is None
    assert mod.e2e(1.0, None) is None and mod.ttft(1.0, []) is None and mod.itl([1.0]) == []


@pytest.mark.exercise("9.2")
def test_percentiles_by_hand():
    mod = m()
    assert mod.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)  # rank 1.5 of 1,2,3,4
    assert mod.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 · (4 - 3)
    assert mod.percentile([5], 99) == 5 and mod.percentile([1, 2], 0) == 1 and mod.percentile([1, 2], 100) == 2
    # 98 fast requests and two slow ones (chapter 09's example): the mean moves a little, p99 shows the tail
    s = mod.stats([10.0] * 98 + [1000.0] * 2)
    assert s["mean"] == pytest.approx(29.8) and s["median"] == 10.0 and s["p90"] == 10.0
    assert s["p99"] == pytest.approx(1000.0)  # rank 98.01: between xs[98] and xs[99], both 1000
    # one slow request of 100 is too few: rank 98.01 lies 1 % of the way from 10 to 1000, and that is the mean
    one = mod.stats([10.0] * 99 + [1000.0])
    assert one["p99"] == pytest.approx(10 + 0.01 * 990) and one["p99"] == pytest.approx(one["mean"])
    assert mod.stats([]) == {"mean": None, "median": None, "p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError):
        mod.percentile([], 50)
    with pytest.raises(ValueError):
        mod.percentile([1.0], 101)


@pytest.mark.exercise("9.2")
@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_matches_numpy(values, p):
    assert m().percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def run_of_three(mod):
    """Three requests over a 2-second run: A fast, B slow to start, C failed."""
    a = mod.RequestRecord(0.0, [0.1, 0.2, 0.3], 0.3, prompt_tokens=10, output_tokens=3)  # ttft 100 ms, tpot 100 ms
    b = mod.RequestRecord(0.5, [1.5, 1.55], 1.6, prompt_tokens=20, output_tokens=4)  # ttft 1000 ms, tpot 33.3 ms
    c = mod.RequestRecord(1.0, [], None, prompt_tokens=30, success=False, error="HTTP 503")
    return [a, b, c]


@pytest.mark.exercise("9.3")
def test_summary_by_hand():
    mod = m()
    s = mod.summarize(run_of_three(mod), duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 7)  # the failed request counts no tokens
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.5) and s["total_token_throughput"] == pytest.approx(18.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(550) and s["ttft_ms"]["p90"] == pytest.approx(910)
    assert s["tpot_ms"]["median"] == pytest.approx((100 + 100 / 3) / 2)
    assert s["itl_ms"]["mean"] == pytest.approx((100 + 100 + 50) / 3)  # every gap of every request
    assert s["e2e_ms"]["median"] == pytest.approx(700)  # 300 and 1100
    assert s["goodput"] is None
    with pytest.raises(ValueError):
        mod.summarize([], duration=0)


@pytest.mark.exercise("9.3")
def test_goodput_by_hand():
    mod = m()
    run = run_of_three(mod)
    assert mod.summarize(run, 2.0, {"ttft": 0.5})["goodput"] == pytest.approx(0.5)  # only A starts within 500 ms
    assert mod.summarize(run, 2.0, {"tpot": 0.05})["goodput"] == pytest.approx(0.5)  # only B's tokens come fast
    assert mod.summarize(run, 2.0, {"ttft": 0.5, "tpot": 0.05})["goodput"] == 0  # every SLO at once: nobody
    assert mod.summarize(run, 2.0, {"e2e": 2.0})["goodput"] == pytest.approx(1.0)  # the failed one never counts
    # one token: no decode to be slow at, so it passes a TPOT SLO; no token fails a TTFT SLO
    assert mod.meets_slos({"ttft": 0.1, "tpot": None, "itl": [], "e2e": 0.1}, {"tpot": 0.01})
    assert not mod.meets_slos({"ttft": None, "tpot": None, "itl": [], "e2e": 0.1}, {"ttft": 1.0})
    with pytest.raises(ValueError):
        mod.meets_slos({"ttft": 0.1, "tpot": None, "itl": [], "e2e": 0.1}, {"itl": 1.0})


def test_engine_sequence_uses_the_same_definitions():
    """Sequence.metrics() on the engine's clock: arrival at 1.0, tokens at 1.4, 1.5, 1.7, finished at 1.7."""
    seq = Sequence("a", [1, 2, 3], max_tokens=3, arrival_time=1.0)
    seq.scheduled_time = 1.1
    for t, token in zip([1.4, 1.5, 1.7], [7, 8, 9]):
        seq.append_token(token, t)
    seq.finished_time = 1.7
    got = seq.metrics()
    assert got["queue_time"] == pytest.approx(0.1) and got["ttft"] == pytest.approx(0.4)
    assert got["itl"] == pytest.approx([0.1, 0.2]) and got["e2e"] == pytest.approx(0.7)
    assert got["tpot"] == pytest.approx(0.15)  # (0.7 - 0.4) / 2
    one = Sequence("b", [1], max_tokens=1, arrival_time=0.0)
    one.append_token(5, 0.2)
    assert one.metrics()["tpot"] is None and one.metrics()["itl"] == [] and one.metrics()["e2e"] is None
