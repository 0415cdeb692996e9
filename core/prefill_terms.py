"""Per-instance step terms of the prefill projection: each instance's own (calibrated) terms beside the shared ones.

The dispatcher's projection (core/prefill.py `PrefillQueues`) steps every prefill instance with the
profile's terms (the prefill ones from the online estimator). A live console that calibrates each
engine (core/calibration/online.py) gives an instance its own `StepTerms` here; the others keep the
shared ones. `alone_s` answers for every instance at once, vectorised, as `StepTerms.alone_array`
does for one set of terms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from core.step_terms import StepTerms


class InstanceTerms:
    """Instance index → its own `StepTerms`, and the coefficient arrays `alone_s` reads."""

    def __init__(self) -> None:
        self.own: dict[int, StepTerms] = {}
        """The instances that have their own terms (the rest use the shared ones)."""
        self._key: tuple[StepTerms, int, int] | None = None
        self._coef = np.zeros((7, 0))
        """Rows: fixed cost per step, per KV token, per token, per token², token budget, chunked (1 or 0),
        the intake's host work."""
        self._version = 0

    def __bool__(self) -> bool:
        return bool(self.own)

    def set(self, p: int, terms: StepTerms | None) -> None:
        """Instance p's own terms from now on (None: the shared ones again)."""
        if terms is None:
            if self.own.pop(p, None) is not None:
                self._version += 1
        elif self.own.get(p) != terms:
            self.own[p] = terms
            self._version += 1

    def of(self, p: int, shared: StepTerms) -> StepTerms:
        """The terms instance p is projected with."""
        return self.own.get(p, shared)

    def _coefficients(self, shared: StepTerms, n: int) -> np.ndarray:
        key = (shared, n, self._version)
        if self._key != key:
            coef = np.empty((7, n))
            for p in range(n):
                t = self.own.get(p, shared)
                coef[:, p] = (
                    t.step_base + t.per_seq + t.base,
                    t.per_kv,
                    t.per_token,
                    t.per_token2,
                    t.budget,
                    1.0 if t.chunked else 0.0,
                    t.host,
                )
            self._coef, self._key = coef, key
        return self._coef

    def alone_s(self, lengths: np.ndarray, shared: StepTerms) -> np.ndarray:
        """Per instance index, `StepTerms.alone_s` of `lengths` (one per instance) with that instance's terms."""
        fixed, per_kv, per_token, per_token2, budget, chunked, host = self._coefficients(shared, len(lengths))
        k = np.where(chunked > 0, np.maximum(np.ceil(lengths / budget), 1.0), 1.0)
        sum_hi = budget * k * (k - 1) / 2 + lengths
        out: np.ndarray = host + k * fixed + per_kv * sum_hi + per_token * lengths + per_token2 * lengths * lengths
        return out
