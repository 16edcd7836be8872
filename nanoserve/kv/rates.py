"""Chapter 18 — the measured rates the load-or-recompute decision (load_policy.py) reads.

The engine feeds every step's (tokens computed, seconds of its forward pass) and every step's loads
(bytes read from the tier, seconds); a least-squares line through each gives a slope — seconds per token,
seconds per byte — and an intercept: a step's fixed overhead (not a cost of recomputing, the step runs anyway)
and a load's fixed latency (a cost of loading).

    fit = LineFit(); fit.add(100, 0.06); fit.add(300, 0.16)
    fit.fit() -> (0.01, 0.0005)          10 ms per step + 0.5 ms per token
"""


class LineFit:
    """Least squares of y = intercept + slope · x over the points seen (sums only: O(1) memory)."""

    def __init__(self):
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx, self.sy, self.sxx, self.sxy = self.sx + x, self.sy + y, self.sxx + x * x, self.sxy + x * y

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope); through the origin (0, sy / sx) while every x seen is the same; None before any."""
        det = self.n * self.sxx - self.sx * self.sx
        if not self.sx:
            return None
        if self.n < 2 or det <= 1e-9 * self.n * self.sxx:
            return 0.0, self.sy / self.sx
        slope = (self.n * self.sxy - self.sx * self.sy) / det
        return (self.sy - slope * self.sx) / self.n, slope


class MeasuredRates:
    """The engine's measured costs: prefill seconds per token (the slope over steps), the tier's seconds per
    byte and fixed latency (a line over loads)."""

    def __init__(self):
        self.steps = LineFit()  # (tokens computed, seconds) of every step
        self.loads = LineFit()  # (bytes read, seconds) of every step's loads

    def prefill_s_per_token(self) -> float | None:
        fit = self.steps.fit()
        return None if fit is None or fit[1] <= 0 else fit[1]

    def tier_bytes_per_s(self) -> float | None:
        fit = self.loads.fit()
        return None if fit is None or fit[1] <= 0 else 1 / fit[1]

    def load_latency_s(self) -> float:
        fit = self.loads.fit()
        return 0.0 if fit is None else max(fit[0], 0.0)
