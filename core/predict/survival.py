"""Remaining output length from the output-length survival function Ŝ (ARES spec §8, option 1).

The predictor shares SIBYL's estimator (core.estimators.SurvivalEstimator: Ŝ(l) ≈ P(L ≥ l) on a
Δ-token grid, an EMA over completions): the dispatcher's live `view.survival`, or one built from
a list of lengths (`from_lengths`, for offline evaluation and training). For a request that has
generated a tokens:

- mean residual life   E[L − a | L > a] = ∫ₐ^max Ŝ(u) du / Ŝ(a)
- median residual life the smallest x with Ŝ(a + x) ≤ ½·Ŝ(a) (the L1-optimal point estimate)
- conditional survival P(L > a + x | L > a) = Ŝ(a + x) / Ŝ(a), for expected load trajectories

Predictions are clamped to [1, max_len − a]: a request never runs past the model's output cap.
Conditioning on age gives ARES's "re-predict as tokens arrive" for free: old requests in a
heavy-tailed workload are predicted long.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from core.estimators import SurvivalEstimator

Statistic = Literal["mean", "median"]
_TINY = 1e-9


class SurvivalPredictor:
    """Point predictions of remaining output tokens, and conditional survival, from Ŝ."""

    def __init__(
        self,
        estimator: SurvivalEstimator,
        *,
        max_len: int | None = None,
        statistic: Statistic = "mean",
    ) -> None:
        self.estimator = estimator
        self.top = int(estimator.grid[-1])
        """The last token Ŝ is tabulated for (the estimator's max_len)."""
        self.max_len = int(max_len) if max_len is not None else self.top
        """Output cap: a request aged a has at most max_len − a tokens left."""
        self.statistic: Statistic = statistic

    @classmethod
    def from_lengths(
        cls,
        lengths: np.ndarray,
        *,
        max_len: int | None = None,
        delta: int = 16,
        statistic: Statistic = "mean",
    ) -> SurvivalPredictor:
        """Ŝ as the empirical P(L ≥ l) of `lengths` (every length weighs the same, no EMA)."""
        lengths = np.asarray(lengths, dtype=float)
        if len(lengths) == 0:
            raise ValueError("a survival predictor needs at least one observed length")
        top = int(max_len if max_len is not None else lengths.max())
        top = max(top, delta)
        est = SurvivalEstimator(delta=delta, max_len=top)
        ordered = np.sort(lengths)
        below = np.searchsorted(ordered, est.grid, side="left")  # count of L < l
        est.values[:] = 1.0 - below / len(ordered)
        est.values[0] = 1.0
        return cls(est, max_len=top, statistic=statistic)

    @classmethod
    def from_table(
        cls, values: np.ndarray, *, delta: int, max_len: int, statistic: Statistic = "mean"
    ) -> SurvivalPredictor:
        """Rebuild a predictor from `table()` (Ŝ on the grid 0, Δ, 2Δ, …)."""
        est = SurvivalEstimator(delta=delta, max_len=int((len(values) - 1) * delta))
        if len(est.values) != len(values):
            raise ValueError(f"survival table of {len(values)} points does not fit delta {delta}")
        est.values[:] = np.asarray(values, dtype=float)
        return cls(est, max_len=max_len, statistic=statistic)

    def table(self) -> tuple[int, np.ndarray]:
        """(Δ, Ŝ on the grid): what `from_table` rebuilds from (pending completions folded in)."""
        self.estimator.flush()
        return self.estimator.delta, self.estimator.values.copy()

    # --- Ŝ --------------------------------------------------------------------------------------
    def survival(self, ages: np.ndarray) -> np.ndarray:
        """Ŝ(a) = P(L ≥ a) at each age (tokens generated)."""
        a = np.maximum(np.asarray(ages, dtype=float), 0.0)
        out: np.ndarray = np.asarray(self.estimator(a), dtype=float)
        return out

    def conditional(self, ages: np.ndarray, ahead: np.ndarray | float) -> np.ndarray:
        """P(L > a + x | L > a) = Ŝ(a + x)/Ŝ(a), in [0, 1]; 0 beyond the output cap.

        `ages` of shape (n,) and `ahead` scalar or broadcastable (e.g. (n, 1) ages against (h,)
        offsets give an (n, h) matrix).
        """
        a = np.maximum(np.asarray(ages, dtype=float), 0.0)
        x = np.asarray(ahead, dtype=float)
        s0 = self.survival(a)
        later = np.maximum(a + x, 0.0)
        s1 = self.survival(later)
        ratio = np.where(s0 > _TINY, s1 / np.maximum(s0, _TINY), 0.0)
        out: np.ndarray = np.where(later >= self.max_len, 0.0, np.clip(ratio, 0.0, 1.0))
        return out

    # --- point predictions ------------------------------------------------------------------------
    def mean_remaining(self, ages: np.ndarray) -> np.ndarray:
        """E[L − a | L > a] (mean residual life), clamped to [1, max_len − a]."""
        a = np.clip(np.asarray(ages, dtype=float), 0.0, float(self.top))
        end = np.full(len(a), float(min(self.top, self.max_len)))
        area = self.estimator.integral_at(end) - self.estimator.integral_at(np.minimum(a, end))
        s0 = self.survival(a)
        mrl = np.where(s0 > _TINY, area / np.maximum(s0, _TINY), 1.0)
        return self._clamp(mrl, np.asarray(ages, dtype=float))

    def median_remaining(self, ages: np.ndarray) -> np.ndarray:
        """The smallest x with Ŝ(a + x) ≤ ½·Ŝ(a), clamped to [1, max_len − a]."""
        dense, _, _ = self.estimator.integrals()
        a_raw = np.asarray(ages, dtype=float)
        a = np.clip(a_raw, 0.0, float(len(dense) - 1)).astype(np.int64)
        half = 0.5 * dense[a]
        # Ŝ is non-increasing, so −Ŝ is sorted: the first index where Ŝ ≤ half.
        j = np.searchsorted(-dense, -half, side="left")
        j = np.maximum(j, a)
        never = half <= _TINY
        x = np.where(never, 1.0, (j - a).astype(float))
        return self._clamp(x, a_raw)

    def remaining(self, ages: np.ndarray) -> np.ndarray:
        """The configured point prediction (mean or median residual life)."""
        if self.statistic == "median":
            return self.median_remaining(ages)
        return self.mean_remaining(ages)

    def _clamp(self, x: np.ndarray, ages: np.ndarray) -> np.ndarray:
        cap = np.maximum(self.max_len - ages, 1.0)
        out: np.ndarray = np.clip(x, 1.0, cap)
        return out
