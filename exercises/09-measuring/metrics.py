"""Exercises 9.1–9.3 — the serving metrics, from raw timestamps.

This file mirrors nanoserve/metrics.py (read its docstring for the picture, not its code). A request
arrives as a RequestRecord (given): `start`, `chunk_times` (one per streamed chunk that carried
output), `end`, `prompt_tokens`, `output_tokens` (from the server's usage), `success`, `error`.

    start = 0.0, chunks at 0.5, 0.6, 0.8, end = 0.8, 3 output tokens
    TTFT = 0.5   ITL = [0.1, 0.2]   E2E = 0.8   TPOT = (0.8 - 0.5) / (3 - 1) = 0.15

Grade with `make grade CH=09`; report a real benchmark with your code: `python -m nanoserve bench serve --student ...`.
"""

from nanoserve.metrics import PERCENTILES, RequestRecord  # noqa: F401  (given)


# ---- 9.1: one request -------------------------------------------------------------------------
def ttft(start: float, chunk_times: list[float]) -> float | None:
    """Time to first token: start -> the first chunk. None if no chunk came."""
    raise NotImplementedError("Exercise 9.1: ttft")


def itl(chunk_times: list[float]) -> list[float]:
    """Every gap between consecutive chunks; [] for fewer than two."""
    raise NotImplementedError("Exercise 9.1: itl")


def e2e(start: float, end: float | None) -> float | None:
    """start -> end; None while unfinished (end is None)."""
    raise NotImplementedError("Exercise 9.1: e2e")


def tpot(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None if either is None or there are fewer than 2 tokens."""
    raise NotImplementedError("Exercise 9.1: tpot")


def request_latencies(record: RequestRecord) -> dict:
    """{"ttft", "tpot", "itl", "e2e"} of one request, from the four functions above.
    A failed request (record.success False): {"ttft": None, "tpot": None, "itl": [], "e2e": None}."""
    raise NotImplementedError("Exercise 9.1: request_latencies")


# ---- 9.2: percentiles -------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the nearest ranks of the sorted values: rank = p / 100 · (n - 1).
    ValueError for no values or p outside [0, 100].

    percentile([4, 1, 3, 2], 90) == 3.7     (sorted [1, 2, 3, 4]; rank 2.7: 3 + 0.7 · (4 - 3))
    percentile([5.0], 99) == 5.0"""
    raise NotImplementedError("Exercise 9.2: percentile")


def stats(values: list[float], percentiles=PERCENTILES) -> dict[str, float | None]:
    """{"mean", "median", "p50", "p90", "p99"} (one "pNN" per entry of `percentiles`); all None for [].

    stats([1, 2, 3, 4]) == {"mean": 2.5, "median": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97} (to rounding)"""
    raise NotImplementedError("Exercise 9.2: stats")


# ---- 9.3: goodput and the summary of a run --------------------------------------------------------
def meets_slos(latencies: dict, slos: dict[str, float]) -> bool:
    """Whether every SLO in {"ttft" | "tpot" | "e2e": seconds} holds (value <= limit). A None TTFT or E2E fails,
    a None TPOT (one token) passes; an unknown SLO name is a ValueError.

    meets_slos({"ttft": 0.4, "tpot": 0.05, "e2e": 2.0}, {"ttft": 0.5, "tpot": 0.04}) is False   (TPOT over)
    meets_slos({"ttft": 0.4, "tpot": None, "e2e": 0.4}, {"ttft": 0.5, "tpot": 0.04}) is True    (one token)"""
    raise NotImplementedError("Exercise 9.3: meets_slos")


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None,
              percentiles=PERCENTILES) -> dict:
    """completed, failed, duration_s, total_input_tokens, total_output_tokens, request_throughput,
    output_throughput, total_token_throughput (successful requests only, per second), goodput (requests
    meeting every SLO per second, None without SLOs) and ttft_ms, tpot_ms, itl_ms, e2e_ms: stats() in
    milliseconds. ValueError for duration <= 0."""
    raise NotImplementedError("Exercise 9.3: summarize")
