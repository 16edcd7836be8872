"""Chapter 09 — what "fast" means for a server, computed from raw timestamps. The one definition of
every latency the course reports: the engine (`Sequence.metrics()`), `bench offline`, `bench serve`
and the server's /metrics histograms all call these functions.

One request, seen by whoever holds the clock (the client in `bench serve`, the engine inside the server):

    start            first token           ...  token  token          end
      |------ TTFT ------|-- ITL --|-- ITL --|--ITL--|                  |
      |--------------------------------- E2E ----------------------------|
      TPOT = (E2E - TTFT) / (output tokens - 1): the mean time per token after the first

    start = 0.0, tokens at 0.5, 0.6, 0.8, end = 0.8, 3 output tokens
    TTFT = 0.5   ITL = [0.1, 0.2]   E2E = 0.8   TPOT = (0.8 - 0.5) / 2 = 0.15

ITL is measured between *chunks* (what a reader of the stream sees arrive); TPOT divides by *tokens*
(from the server's `usage`), so a server that sends two tokens per chunk has ITLs twice its TPOT.
Corner cases: one output token has no TPOT and no ITL (nothing after the first); a request that
produced no token has no TTFT either; a failed request has no latencies at all: it is counted as
failed, never averaged in.

Every time here is in seconds; `summarize` reports milliseconds, as serving benchmarks print them.
"""

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """The raw facts of one request: when it started, when each streamed chunk with text arrived, when it ended."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # one per chunk that carried output
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0  # from the server's `usage` (or its tokenizer), never by counting chunks
    success: bool = True
    error: str = ""


def ttft(start: float, chunk_times: list[float]) -> float | None:
    """Time to first token: start -> the first chunk with output. None if nothing came."""
    return chunk_times[0] - start if chunk_times else None


def itl(chunk_times: list[float]) -> list[float]:
    """Inter-token latencies: every gap between consecutive chunks. [] for fewer than two."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def e2e(start: float, end: float | None) -> float | None:
    """End-to-end latency: start -> the last byte of the response. None while unfinished."""
    return None if end is None else end - start


def tpot(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1). None below 2 tokens."""
    if ttft_s is None or e2e_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100), interpolated linearly between the two nearest ranks (numpy's default).

    percentile([1, 2, 3, 4], 50) = 2.5: rank 0.5 · 3 = 1.5 lies halfway between the values 2 and 3.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def stats(values: list[float], percentiles=PERCENTILES) -> dict[str, float | None]:
    """mean, median and the given percentiles of `values`; every entry None when there are none."""
    keys = ["mean", "median"] + [f"p{p:g}" for p in percentiles]
    if not values:
        return dict.fromkeys(keys)
    return dict(zip(keys, [sum(values) / len(values), percentile(values, 50)] + [percentile(values, p) for p in percentiles]))


def request_latencies(record: RequestRecord) -> dict:
    """ttft, tpot, itl, e2e of one request (seconds); None (and itl []) for a failed one."""
    if not record.success:
        return {"ttft": None, "tpot": None, "itl": [], "e2e": None}
    first, total = ttft(record.start, record.chunk_times), e2e(record.start, record.end)
    return {"ttft": first, "tpot": tpot(first, total, record.output_tokens), "itl": itl(record.chunk_times), "e2e": total}


def meets_slos(latencies: dict, slos: dict[str, float]) -> bool:
    """Whether one successful request met every SLO given, as {"ttft" | "tpot" | "e2e": seconds}.

    A missing TTFT (no token at all) fails a TTFT SLO; a missing TPOT (one token: no decode) passes a TPOT SLO.
    """
    unknown = set(slos) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"unknown SLO(s) {sorted(unknown)}; known: ttft, tpot, e2e")
    for name, limit in slos.items():
        value = latencies[name]
        if value is None and name == "tpot":
            continue
        if value is None or value > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None,
              percentiles=PERCENTILES) -> dict:
    """The benchmark's summary over a run of `duration` seconds: counts, throughputs, goodput and latency stats (ms).

    Throughputs count successful requests only: a failed request's tokens are not work done.
    goodput = successful requests that met every SLO, per second (None without SLOs).
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    lat = [request_latencies(r) for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)

    def ms(name):
        return stats([x * 1000 for x in (m[name] for m in lat) if x is not None], percentiles)

    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "goodput": None if not slos else sum(meets_slos(m, slos) for m in lat) / duration,
        "ttft_ms": ms("ttft"),
        "tpot_ms": ms("tpot"),
        "itl_ms": stats([x * 1000 for m in lat for x in m["itl"]], percentiles),
        "e2e_ms": ms("e2e"),
    }
