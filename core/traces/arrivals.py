"""Open-loop arrival processes: Poisson and gamma inter-arrival times as in `vllm bench serve`."""

from __future__ import annotations

import math

import numpy as np

from core.errors import TraceError


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise TraceError(f"number of arrivals must be >= 0, got {n}")
    if not rate > 0:
        raise TraceError(f"arrival rate must be > 0 req/s (math.inf for all at once), got {rate}")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    """Arrival times from n−1 gaps: the first request arrives at 0.0, as `vllm bench serve`
    sends its first request immediately and sleeps one gap after each request."""
    out = np.zeros(len(gaps) + 1, dtype=np.float64)
    np.cumsum(gaps, out=out[1:])
    return out


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times (seconds, first at 0.0) with gamma inter-arrival gaps of mean 1/rate.

    Gamma shape = ``burstiness``, scale = 1 / (rate · burstiness), so the gaps' coefficient of
    variation is 1/sqrt(burstiness): 1.0 is Poisson, smaller is burstier, larger is smoother.
    ``rate = math.inf`` puts every arrival at 0.0.
    """
    _check(n, rate)
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise TraceError(f"burstiness must be a positive finite number, got {burstiness}")
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    if math.isinf(rate):
        return np.zeros(n, dtype=np.float64)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return _from_gaps(gaps)


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` Poisson arrival times (exponential gaps of mean 1/rate), first at 0.0."""
    _check(n, rate)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    if math.isinf(rate):
        return np.zeros(n, dtype=np.float64)
    return _from_gaps(rng.exponential(scale=1.0 / rate, size=n - 1))


def index_of_dispersion(arrivals: np.ndarray, bin_s: float = 1.0) -> float:
    """Variance / mean of arrival counts per ``bin_s``-second bin (1.0 for Poisson; larger is
    burstier). NaN when there are no arrivals."""
    arr = np.asarray(arrivals, dtype=np.float64)
    if len(arr) == 0:
        return math.nan
    if not bin_s > 0:
        raise TraceError(f"bin width must be > 0 s, got {bin_s}")
    bins = np.floor((arr - arr[0]) / bin_s).astype(np.int64)
    counts = np.bincount(bins)
    mean = float(counts.mean())
    return float(counts.var()) / mean if mean > 0 else math.nan
