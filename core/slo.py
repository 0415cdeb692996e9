"""SLO accounting: per-request TTFT/TPOT/ITL/E2E, attainment, goodput, exact percentiles, live windows."""

from __future__ import annotations

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
    """Per-request: succeeded and met both TTFT and TPOT limits of its class."""
    if isinstance(slo, SLOClass):
        ttft_lim = np.full(len(ttft_s), slo.ttft_s)
        tpot_lim = np.full(len(ttft_s), slo.tpot_s)
    else:
        names = classes or ["default"] * len(ttft_s)
        fallback = slo.get("default", DEFAULT_SLO)
        ttft_lim = np.array([slo.get(c, fallback).ttft_s for c in names])
        tpot_lim = np.array([slo.get(c, fallback).tpot_s for c in names])
    return ok & (ttft_s <= ttft_lim) & (tpot_s <= tpot_lim)


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


@dataclass
class _Sample:
    t: float
    ttft: float
    tpot: float
    ok: bool
    met: bool
    ttft_limit: float
    tpot_limit: float


class SlidingWindow:
    """Outcomes of the last `window_s` seconds plus whole-run totals, for live views."""

    def __init__(self, window_s: float = 60.0, slo: dict[str, SLOClass] | None = None) -> None:
        self.window_s = window_s
        self.slo = slo or {"default": DEFAULT_SLO}
        self._recent: deque[_Sample] = deque()
        self._all_ttft: list[float] = []
        self._all_tpot: list[float] = []
        self.total = 0
        self.total_met = 0
        self.total_failed = 0

    def add(
        self, now: float, ttft_s: float, tpot_s: float, ok: bool, slo_class: str = "default"
    ) -> bool:
        cls = self.slo.get(slo_class) or self.slo.get("default", DEFAULT_SLO)
        is_met = ok and ttft_s <= cls.ttft_s and tpot_s <= cls.tpot_s
        self._recent.append(_Sample(now, ttft_s, tpot_s, ok, is_met, cls.ttft_s, cls.tpot_s))
        self.total += 1
        self.total_met += is_met
        if ok:
            self._all_ttft.append(ttft_s)
            self._all_tpot.append(tpot_s)
        else:
            self.total_failed += 1
        return is_met

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0].t < now - self.window_s:
            self._recent.popleft()

    def snapshot(self, now: float) -> dict[str, Any]:
        self._prune(now)
        recent = list(self._recent)

        def stats(
            samples: list[_Sample],
            ttfts: np.ndarray,
            tpots: np.ndarray,
            n: int,
            n_met: int,
            failed: int,
        ) -> dict[str, Any]:
            return {
                "requests": n,
                "failed": failed,
                "attainment": n_met / n if n else None,
                "ttft_attainment": float(
                    np.mean([s.ok and s.ttft <= s.ttft_limit for s in samples])
                )
                if samples
                else None,
                "tpot_attainment": float(
                    np.mean([s.ok and s.tpot <= s.tpot_limit for s in samples])
                )
                if samples
                else None,
                "ttft_p50": percentile(ttfts, 50) if len(ttfts) else None,
                "ttft_p99": percentile(ttfts, 99) if len(ttfts) else None,
                "tpot_p50": percentile(tpots, 50) if len(tpots) else None,
                "tpot_p99": percentile(tpots, 99) if len(tpots) else None,
            }

        ok_recent = [s for s in recent if s.ok]
        window = stats(
            recent,
            np.array([s.ttft for s in ok_recent]),
            np.array([s.tpot for s in ok_recent]),
            len(recent),
            sum(s.met for s in recent),
            sum(not s.ok for s in recent),
        )
        window["goodput_req_s"] = sum(s.met for s in recent) / self.window_s
        run = stats(
            [],
            np.array(self._all_ttft),
            np.array(self._all_tpot),
            self.total,
            self.total_met,
            self.total_failed,
        )
        return {"window_s": self.window_s, "window": window, "run": run}
