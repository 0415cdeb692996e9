"""SLO accounting: per-request TTFT/TPOT/ITL/E2E, attainment, goodput, exact percentiles, live windows."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class SLOClass(BaseModel):
    """Latency targets a request of this class must meet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "default"
    ttft_s: float = Field(2.0, gt=0, description="time to first token limit, seconds")
    tpot_s: float = Field(0.1, gt=0, description="mean time per output token limit, seconds")


DEFAULT_SLO = SLOClass()


def ttft(arrival: np.ndarray, first_token: np.ndarray) -> np.ndarray:
    return np.asarray(first_token - arrival)


def tpot(first_token: np.ndarray, finish: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """(finish − first token) / (output tokens − 1); 0 for single-token outputs."""
    steps = np.maximum(output_tokens - 1, 1)
    return np.where(output_tokens > 1, (finish - first_token) / steps, 0.0)


def itl(token_times: np.ndarray) -> np.ndarray:
    """Inter-token latencies of one request from its token timestamps."""
    return np.diff(token_times)


def percentile(values: np.ndarray, q: float) -> float:
    """Exact (linear-interpolated) percentile over all values; NaN when empty."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def met(
    ttft_s: np.ndarray,
    tpot_s: np.ndarray,
    ok: np.ndarray,
    slo: SLOClass | dict[str, SLOClass] = DEFAULT_SLO,
    classes: list[str] | None = None,
) -> np.ndarray:
    """Per-request: succeeded and met both TTFT and TPOT limits of its class.

    A latency that was not measured is NaN and is judged on what is known: a request with a NaN
    TPOT (a whole, non-streamed reply) meets its SLO when it succeeded and met its TTFT limit."""
    if isinstance(slo, SLOClass):
        ttft_lim = np.full(len(ttft_s), slo.ttft_s)
        tpot_lim = np.full(len(ttft_s), slo.tpot_s)
    else:
        names = classes or ["default"] * len(ttft_s)
        fallback = slo.get("default", DEFAULT_SLO)
        ttft_lim = np.array([slo.get(c, fallback).ttft_s for c in names])
        tpot_lim = np.array([slo.get(c, fallback).tpot_s for c in names])
    return ok & ~(ttft_s > ttft_lim) & ~(tpot_s > tpot_lim)  # NaN > x is False: unknown is not a miss


def summarize(
    *,
    arrival: np.ndarray,
    first_token: np.ndarray,
    finish: np.ndarray,
    output_tokens: np.ndarray,
    ok: np.ndarray,
    slo: SLOClass = DEFAULT_SLO,
) -> dict[str, Any]:
    """Run-level metrics in seconds: percentiles over successful requests, attainment over all."""
    n = len(arrival)
    good = ok.astype(bool)
    t1 = ttft(arrival[good], first_token[good])
    tp = tpot(first_token[good], finish[good], output_tokens[good])
    e2e = finish[good] - arrival[good]
    span = float(finish[good].max() - arrival.min()) if good.any() else 0.0
    meets = np.zeros(n, dtype=bool)
    meets[good] = met(t1, tp, np.ones(len(t1), dtype=bool), slo)
    tokens = float(output_tokens[good].sum())
    return {
        "requests": n,
        "completed": int(good.sum()),
        "failed": int(n - good.sum()),
        "duration_s": span,
        "throughput_tok_s": tokens / span if span > 0 else 0.0,
        "ttft_mean": float(t1.mean()) if len(t1) else float("nan"),
        "ttft_p50": percentile(t1, 50),
        "ttft_p99": percentile(t1, 99),
        "tpot_mean": float(tp.mean()) if len(tp) else float("nan"),
        "tpot_p50": percentile(tp, 50),
        "tpot_p99": percentile(tp, 99),
        "tpot_p999": percentile(tp, 99.9),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "ttft_attainment": float((t1 <= slo.ttft_s).sum() / n) if n else float("nan"),
        "tpot_attainment": float((tp <= slo.tpot_s).sum() / n) if n else float("nan"),
        "slo_attainment": float(meets.mean()) if n else float("nan"),
        "goodput_req_s": float(meets.sum() / span) if span > 0 else 0.0,
    }


@dataclass(slots=True)
class _Sample:
    t: float
    ttft: float | None
    tpot: float | None
    ok: bool
    met: bool
    ttft_met: bool
    tpot_met: bool
    ttft_judged: bool
    """Counts in TTFT attainment: failed (a miss), or succeeded with a measured TTFT."""
    tpot_judged: bool
    """Counts in TPOT attainment: failed (a miss), or succeeded with a measured TPOT."""


class LogHistogram:
    """Counts of positive values in log-spaced bins: percentiles within BIN_ERROR in O(bins), any
    number of samples in fixed memory, and samples can be taken out again (sliding windows)."""

    LO, HI, BINS = 1e-5, 1e5, 4096
    BIN_ERROR = (HI / LO) ** (1 / BINS) - 1.0
    """Relative width of one bin (≈ 0.56%); a percentile is reported at its bin's geometric middle."""

    def __init__(self) -> None:
        self.counts = np.zeros(self.BINS, dtype=np.int64)
        self.n = 0
        self._scale = self.BINS / math.log(self.HI / self.LO)
        self._log_lo = math.log(self.LO)

    def add(self, x: float, k: int = 1) -> None:
        b = 0 if x <= self.LO else min(int((math.log(x) - self._log_lo) * self._scale), self.BINS - 1)
        self.counts[b] += k
        self.n += k

    def percentile(self, q: float) -> float | None:
        if self.n <= 0:
            return None
        rank = max(1, math.ceil(q / 100 * self.n))
        b = int(np.searchsorted(np.cumsum(self.counts), rank))
        return math.exp(self._log_lo + (b + 0.5) / self._scale)


class SlidingWindow:
    """Outcomes of the last `window_s` seconds plus whole-run totals, for live views.

    Kept incrementally (counters and log histograms), so a snapshot costs the same after a
    million requests as after ten and memory does not grow with the run; percentiles are
    within LogHistogram.BIN_ERROR (the run store keeps every request's exact figures).

    A latency given as None was not measured (a whole, non-streamed reply has no TPOT). Such a
    request is judged on what is known: it is left out of that latency's attainment (numerator
    and denominator) and percentiles, and it meets its SLO when it succeeded and every measured
    latency met its limit. A failed request misses everything and counts in every attainment."""

    def __init__(self, window_s: float = 60.0, slo: dict[str, SLOClass] | None = None) -> None:
        self.window_s = window_s
        self.slo = slo or {"default": DEFAULT_SLO}
        self._recent: deque[_Sample] = deque()
        self._win = self._counters()
        self._run = self._counters()
        self._win_ttft, self._win_tpot = LogHistogram(), LogHistogram()
        self._run_ttft, self._run_tpot = LogHistogram(), LogHistogram()

    @staticmethod
    def _counters() -> dict[str, int]:
        return {
            "n": 0,
            "met": 0,
            "failed": 0,
            "ttft_met": 0,
            "tpot_met": 0,
            "ttft_n": 0,
            "tpot_n": 0,
            "tpot_unknown": 0,
        }

    @property
    def total(self) -> int:
        return self._run["n"]

    def add(self, now: float, ttft_s: float | None, tpot_s: float | None, ok: bool, slo_class: str = "default") -> bool:
        """One finished request; None for a latency that was not measured. Returns whether it met its SLO."""
        cls = self.slo.get(slo_class) or self.slo.get("default", DEFAULT_SLO)
        ttft_met = ok and ttft_s is not None and ttft_s <= cls.ttft_s
        tpot_met = ok and tpot_s is not None and tpot_s <= cls.tpot_s
        is_met = ok and (ttft_s is None or ttft_met) and (tpot_s is None or tpot_met)
        sample = _Sample(
            now,
            ttft_s,
            tpot_s,
            ok,
            is_met,
            ttft_met,
            tpot_met,
            ttft_judged=not ok or ttft_s is not None,
            tpot_judged=not ok or tpot_s is not None,
        )
        self._recent.append(sample)
        self._count(self._win, sample, 1, self._win_ttft, self._win_tpot)
        self._count(self._run, sample, 1, self._run_ttft, self._run_tpot)
        return is_met

    @staticmethod
    def _count(c: dict[str, int], s: _Sample, k: int, ttft: LogHistogram, tpot: LogHistogram) -> None:
        c["n"] += k
        c["met"] += k * s.met
        c["failed"] += k * (not s.ok)
        c["ttft_met"] += k * s.ttft_met
        c["tpot_met"] += k * s.tpot_met
        c["ttft_n"] += k * s.ttft_judged
        c["tpot_n"] += k * s.tpot_judged
        c["tpot_unknown"] += k * (s.ok and s.tpot is None)
        if s.ok:
            if s.ttft is not None:
                ttft.add(s.ttft, k)
            if s.tpot is not None:
                tpot.add(s.tpot, k)

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0].t < now - self.window_s:
            self._count(self._win, self._recent.popleft(), -1, self._win_ttft, self._win_tpot)

    @staticmethod
    def _stats(c: dict[str, int], ttft: LogHistogram, tpot: LogHistogram) -> dict[str, Any]:
        n = c["n"]
        return {
            "requests": n,
            "failed": c["failed"],
            "attainment": c["met"] / n if n else None,
            "ttft_attainment": c["ttft_met"] / c["ttft_n"] if c["ttft_n"] else None,
            "tpot_attainment": c["tpot_met"] / c["tpot_n"] if c["tpot_n"] else None,
            "tpot_unknown": c["tpot_unknown"],
            "ttft_p50": ttft.percentile(50),
            "ttft_p99": ttft.percentile(99),
            "tpot_p50": tpot.percentile(50),
            "tpot_p99": tpot.percentile(99),
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        self._prune(now)
        window = self._stats(self._win, self._win_ttft, self._win_tpot)
        window["goodput_req_s"] = self._win["met"] / self.window_s
        run = self._stats(self._run, self._run_ttft, self._run_tpot)
        return {"window_s": self.window_s, "window": window, "run": run}
