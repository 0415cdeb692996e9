"""Online estimators the dispatcher keeps: output-length survival Ŝ, prefill time, decode rates."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.perf import PerfProfile


class SurvivalEstimator:
    """Ŝ(l) ≈ P(output length > l) on bucket boundaries l = 0, Δ, 2Δ, …, kept as an EMA of indicators.

    On each completion with final length L every bucket is updated,
    Ŝ(l) ← α·Ŝ(l) + (1−α)·[L ≥ l]  (SIBYL eq. 4; the paper's "l ≤ L_final" would never let Ŝ
    decrease, so all buckets move). Between boundaries Ŝ is interpolated linearly; beyond the
    last boundary it keeps the last value. The prior is uniform output lengths on [0, prior_max].
    """

    def __init__(
        self,
        delta: int = 64,
        alpha: float = 0.99,
        max_len: int = 8192,
        prior_max: int | None = None,
        fold_every: int = 8,
    ) -> None:
        if delta <= 0 or not 0.0 < alpha < 1.0 or max_len < delta:
            raise ValueError("survival estimator needs delta > 0, 0 < alpha < 1, max_len >= delta")
        self.delta = delta
        self.alpha = alpha
        self.grid = np.arange(0, max_len + delta, delta, dtype=float)
        top = float(prior_max if prior_max is not None else max_len)
        self.values = np.clip(1.0 - self.grid / max(top, 1.0), 0.0, 1.0)
        self.values[0] = 1.0
        self.observations = 0
        self._pending: list[float] = []
        self.fold_every = fold_every
        """Completions are folded in batches (exactly, in order); the EMA remembers ~1/(1−α) of them."""
        self._dense: np.ndarray | None = None
        self._integral: tuple[np.ndarray, np.ndarray] | None = None
        self._steps = np.arange(delta, dtype=float)
        self._tpot: tuple[np.ndarray, np.ndarray] | None = None

    def observe(self, final_length: float) -> None:
        """Record one completed request's output length (folded in at the next query)."""
        self._pending.append(final_length)
        self.observations += 1

    def _fold(self) -> None:
        """Apply the buffered updates in order: m EMA steps in one vectorised pass.

        After m observations L_1..L_m, Ŝ(l) = α^m·Ŝ(l) + Σ_i (1−α)·α^(m−i)·[L_i ≥ l]; the indicator
        is a prefix of the grid, so the sum is a reversed cumulative sum of per-bucket weights.
        """
        lengths = np.asarray(self._pending)
        self._pending = []
        m = len(lengths)
        a = self.alpha
        weights = (1.0 - a) * a ** np.arange(m - 1, -1, -1, dtype=float)
        last = np.minimum(np.floor(lengths / self.delta).astype(np.int64), len(self.values) - 1)
        per_bucket = np.bincount(last, weights=weights, minlength=len(self.values))
        self.values *= a**m
        self.values += np.cumsum(per_bucket[::-1])[::-1]
        self.values[0] = 1.0
        self._dense = None

    def _tables(self) -> np.ndarray:
        if len(self._pending) >= self.fold_every:
            self._fold()
        if self._dense is None:
            # np.interp on the uniform grid, bucket by bucket: slope·k + Ŝ(l_j) for k < Δ (the
            # same arithmetic, several times faster than a 40k-point interp after every fold).
            v = self.values
            slope = np.diff(v) / np.diff(self.grid)
            dense = np.empty((len(v) - 1) * self.delta + 1)
            np.multiply(slope[:, None], self._steps, out=dense[:-1].reshape(len(v) - 1, self.delta))
            dense[:-1].reshape(len(v) - 1, self.delta)[...] += v[:-1, None]
            dense[-1] = v[-1]
            self._dense = dense
            self._integral = None
            self._tpot = None
        return self._dense

    def __call__(self, lengths: np.ndarray | float) -> Any:
        """Ŝ at the given generated lengths ≥ 0, from a per-token table (one gather, no search)."""
        dense = self._tables()
        if isinstance(lengths, np.ndarray):
            # Truncate to a token, then gather with indices clipped to the table (one pass).
            return np.take(dense, lengths.astype(np.int64), mode="clip")
        idx = np.minimum(np.asarray(lengths), len(dense) - 1).astype(np.int64)
        return dense[idx]

    def integrals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-token tables (Ŝ, I, J) with I(x) = ∫₀ˣ Ŝ and J(x) = ∫₀ˣ u·Ŝ(u) du (trapezoid).

        I(x) is the expected number of tokens a request of age 0 generates in its first x, so
        [I(x₁) − I(x₀)]/Ŝ(x₀) is how long (in tokens) a request aged x₀ is expected to stay alive
        within the next x₁ − x₀ tokens. J does the same for its KV tokens. Beyond the table the
        curve keeps its last value (see `integral_at`).
        """
        dense = self._tables()
        if self._integral is None:
            u = np.arange(len(dense), dtype=float)
            mid = 0.5 * (dense[1:] + dense[:-1])
            umid = 0.5 * (u[1:] * dense[1:] + u[:-1] * dense[:-1])
            integ = np.zeros(len(dense))
            mom = np.zeros(len(dense))
            np.cumsum(mid, out=integ[1:])
            np.cumsum(umid, out=mom[1:])
            self._integral = (integ, mom)
        return dense, self._integral[0], self._integral[1]

    def integral_at(self, x: np.ndarray, moment: bool = False) -> np.ndarray:
        """I(x) (or J(x) with `moment`) at real x ≥ 0, linear within a token, extrapolated beyond."""
        dense, integ, mom = self.integrals()
        top = len(dense) - 1
        xc = np.minimum(x, float(top))
        i = xc.astype(np.int64)
        frac = xc - i
        last = dense[top]
        if not moment:
            out = integ[i] + frac * dense[i]
            return np.asarray(out + last * (x - xc) if last > 0 else out)
        out = mom[i] + frac * i * dense[i]
        return np.asarray(out + last * 0.5 * (x * x - xc * xc) if last > 0 else out)

    def tpot_weight_cdf(self, x: np.ndarray) -> np.ndarray:
        """C(x) = E[min(x, L)/L]: the share of a new request's expected TPOT spent in its first x tokens.

        A request of length L spreads its TPOT evenly over its L tokens, so the token at age u
        weighs w(u) = E[1{L > u}/L] and C(x) = ∫₀ˣ w = Σ_l P(L = l)·min(x, l)/l, with
        P(L = l) = Ŝ(l − 1) − Ŝ(l) (the mass left at the table's end counts as L = end).
        """
        dense = self._tables()
        if self._tpot is None:
            top = len(dense) - 1
            pmf = np.zeros(top + 1)
            pmf[1:] = dense[:-1] - dense[1:]
            pmf[top] += dense[top]
            lengths = np.maximum(np.arange(top + 1, dtype=float), 1.0)
            cum_p = np.cumsum(pmf)  # P(L ≤ l)
            inv = pmf / lengths
            tail_inv = np.cumsum(inv[::-1])[::-1]  # Σ_{l ≥ x} P(l)/l
            self._tpot = (cum_p, np.append(tail_inv[1:], 0.0))  # Σ_{l > x} P(l)/l
        cum_p, tail = self._tpot
        xi = np.clip(np.asarray(x, dtype=float), 0, len(cum_p) - 1).astype(np.int64)
        out: np.ndarray = cum_p[xi] + xi * tail[xi]
        return out

    def mean_length(self) -> float:
        """E[output length] under Ŝ, truncated at the table's end (∫₀^max Ŝ)."""
        _, integ, _ = self.integrals()
        return float(integ[-1])

    def flush(self) -> None:
        """Fold in every buffered completion now."""
        if self._pending:
            self._fold()


class PrefillTimeEstimator:
    """t(l) = a + b·l + c·l² fitted online by exponentially weighted least squares.

    Starts from the profile's coefficients as a prior worth `prior_weight` observations; each
    observed prefill (prompt tokens, seconds) is folded into the normal equations with forgetting
    factor `forget`, and the coefficients are re-solved lazily.

    What it observes is the work of one prompt, never a wait: the dispatcher feeds it only the
    prefills that ran alone (routed to an idle instance, no other prompt in any of their steps;
    core/prefill.py `PrefillQueues.ran_alone`), less the engine-step costs the batching model
    adds (`StepTerms.alone_s(l) − t(l)`). A prefill measured while others queued or ran with it
    includes them, and folding it in would count that queueing again as per-prompt cost.
    """

    def __init__(
        self,
        profile: PerfProfile,
        prior_weight: float = 20.0,
        forget: float = 0.999,
        refit_every: int = 16,
    ) -> None:
        self.refit_every = refit_every
        self.coef = np.array([profile.prefill_base_s, profile.prefill_per_token_s, profile.prefill_per_token2_s])
        self.forget = forget
        # Prior: pseudo-observations on a spread of prompt lengths, exactly on the profile's curve.
        xs = np.linspace(1, max(profile.max_model_len, 2), 8)
        phi = np.stack([np.ones_like(xs), xs, xs * xs], axis=1)
        w = prior_weight / len(xs)
        self._xtx = w * phi.T @ phi
        self._xty = w * phi.T @ (phi @ self.coef)
        self._dirty = False
        self.observations = 0
        self._pending: list[tuple[float, float]] = []
        self._last = (-1.0, 0.0)
        """The last scalar query and its answer (routing asks twice per request)."""
        self._coef_tuple: tuple[float, float, float] | None = None

    def observe(self, prompt_tokens: float, seconds: float) -> None:
        """Record one prefill; every `refit_every` of them are folded in and the fit re-solved."""
        self._pending.append((prompt_tokens, seconds))
        self.observations += 1
        if len(self._pending) >= self.refit_every or self.observations < self.refit_every:
            self._fold()

    def _fold(self) -> None:
        data = np.asarray(self._pending, dtype=float)
        self._pending = []
        m = len(data)
        w = self.forget ** np.arange(m - 1, -1, -1, dtype=float)
        x, y = data[:, 0], data[:, 1]
        phi = np.stack([np.ones(m), x, x * x], axis=1)
        decay = self.forget**m
        self._xtx = decay * self._xtx + (phi * w[:, None]).T @ phi
        self._xty = decay * self._xty + (phi * w[:, None]).T @ y
        self._dirty = True

    def _solve(self) -> None:
        # Scale columns to keep the 3×3 system well conditioned (l² spans many decades).
        scale = np.sqrt(np.clip(np.diag(self._xtx), 1e-30, None))
        a = self._xtx / np.outer(scale, scale)
        try:
            coef = np.linalg.solve(a, self._xty / scale) / scale
        except np.linalg.LinAlgError:
            coef = np.linalg.lstsq(a, self._xty / scale, rcond=None)[0] / scale
        self.coef = np.maximum(coef, 0.0)
        self._dirty = False
        self._coef_tuple = None

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) now; the same tuple object until the fit changes (callers may cache on it)."""
        if self._dirty or self._coef_tuple is None:
            if self._dirty:
                self._solve()
                self._last = (-1.0, 0.0)
            a, b, c = self.coef
            self._coef_tuple = (float(a), float(b), float(c))
        return self._coef_tuple

    def __call__(self, prompt_tokens: np.ndarray | float) -> np.ndarray | float:
        if self._dirty:
            self._solve()
            self._last = (-1.0, 0.0)
        if isinstance(prompt_tokens, int | float):
            if prompt_tokens == self._last[0]:
                return self._last[1]
            a, b, c = self.coef
            value = float(a + b * prompt_tokens + c * prompt_tokens * prompt_tokens)
            self._last = (float(prompt_tokens), value)
            return value
        a, b, c = self.coef
        return np.asarray(a + b * prompt_tokens + c * np.square(prompt_tokens))


class DecodeRateEstimator:
    """System-average per-request decode rate v̄_sys (tokens/s), an EMA over completed requests."""

    def __init__(self, prior: float, alpha: float = 0.98) -> None:
        if prior <= 0:
            raise ValueError("decode rate prior must be positive")
        self.value = prior
        self.alpha = alpha
        self.observations = 0

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 1 or seconds <= 0:
            return
        self.value = self.alpha * self.value + (1 - self.alpha) * (tokens - 1) / seconds
        self.observations += 1
