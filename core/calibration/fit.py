"""Fitting helpers of `calibrate` (console/offline/calibration.py) and of the online fitter (online.py).

`fit_linear` fits y ≈ X·c where every column is a named profile term with a prior. A term is
fitted only when the run identifies it: the 1σ uncertainty of its contribution (its standard
error times its median regressor value) must be at most `IDENTIFIED` of the median target.
Otherwise a term goes to its prior with the reason (its regressor hardly varies, moves with
another one, or is too noisy) and the rest is refitted; a term the data put below zero is fixed
at 0. Every term comes back with its fit quality: the regression's relative RMS residual over
the points it rested on, the sample count and the relative uncertainty above. Both callers solve
through `lstsq_with_prior` (least squares with the prior as optional pseudo-observations); the
online fitter adds forgetting weights and a ridge toward the prior (`fit_linear`'s `weights`,
`prior_weight`), which `calibrate` leaves off.

`Timeline` rebuilds, on a fine time grid, the decode batch and its resident KV tokens on one
instance from the recorded requests (first token and finish of each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

MAX_REL_RMS = 0.5
"""A regression whose relative RMS residual (over the samples it rests on) is larger than this
fits none of its terms: a small standard error on a few points of a bad model means nothing.
A quantile regression is judged by its residuals' robust scale instead (1.4826 MADs over the
median target): its one-sided tail, which it is fitted to ignore, would swamp an RMS."""
IDENTIFIED = 0.05
"""Largest 1σ uncertainty of a term's contribution, relative to the median target, that counts as a fit."""
REJECT_SE = 3.0
"""An estimate too uncertain (or too small) to count as fitted still replaces a prior it lies this many
of its standard errors away from (`rules_out_prior`)."""


def rules_out_prior(estimate: float, se: float, prior: float) -> bool:
    """Whether a run's `estimate` (±`se`) rules its `prior` out: the prior lies more than REJECT_SE
    standard errors away, so the estimate is nearer the truth even where it is not identified (a
    slower day's wake-up or host work kept as a prior put the emulator 27-40% off real vLLM)."""
    return abs(estimate - prior) > REJECT_SE * se


Method = Literal["robust", "envelope", "quantile"]
"""robust: least squares without outliers (beyond 4 MADs and 3% of the median target); envelope:
refitted on the tenth of the points (at least 3) with the smallest residuals in each third of the
fitted values (queueing only adds time); quantile: quantile regression."""


@dataclass
class Term:
    """One profile term: its value, its prior and where the value came from, with the fit quality."""

    name: str
    value: float
    prior: float | None
    source: str
    """"fit", "fit: clipped at 0 …", "prior: <why>" or "derived: <how>"."""
    rel_rms: float | None = None
    """RMS residual of the regression it came from, relative to the mean target (points it used)."""
    samples: int | None = None
    """Samples in that regression (`used` of them carried the fit: the envelope, no outliers)."""
    used: int | None = None
    rel_se: float | None = None
    """1σ uncertainty of its contribution relative to the median target (≤ IDENTIFIED to be fitted)."""

    def quality(self) -> dict[str, Any]:
        def num(v: float | None) -> float | None:
            return None if v is None or not math.isfinite(v) else v if isinstance(v, int) else float(v)

        return {
            "value": num(self.value),
            "prior": self.prior,
            "source": self.source,
            "rel_rms": num(self.rel_rms),
            "samples": self.samples,
            "used": self.used,
            "rel_se": num(self.rel_se),
        }


@dataclass(frozen=True)
class PriorRows:
    """Pseudo-observations that pull the coefficients toward a prior (ridge regression toward it):
    appended to every least-squares solve, never counted among the samples nor judged as data."""

    x: np.ndarray
    y: np.ndarray


def prior_rows(scale: np.ndarray, values: np.ndarray, weight: float) -> PriorRows | None:
    """One pseudo-observation per column, c_k·scale_k ≈ value_k·scale_k, worth `weight` samples:
    `scale` puts each column in the target's units, so the pull is the same whatever the units of
    the term. None when `weight` is 0 (plain least squares)."""
    if weight <= 0:
        return None
    root = math.sqrt(weight) * np.asarray(scale, dtype=float)
    return PriorRows(np.diag(root), root * np.asarray(values, dtype=float))


def lstsq_with_prior(
    x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None, prior: PriorRows | None = None
) -> np.ndarray:
    """Least squares of y ≈ x·c (each squared residual weighted by `w`), with the prior's
    pseudo-observations appended: the one solve behind `calibrate` and the online fitter
    (core/calibration/online.py)."""
    if w is not None:
        sw = np.sqrt(w)
        x, y = x * sw[:, None], y * sw
    if prior is not None:
        x, y = np.vstack([x, prior.x]), np.concatenate([y, prior.y])
    return np.asarray(np.linalg.lstsq(x, y, rcond=None)[0])


def estimate(
    x: np.ndarray, y: np.ndarray, method: Method, q: float = 0.5, prior: PriorRows | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients of y ≈ x·c, and the mask of the points the estimate rests on (`prior`'s
    pseudo-observations, if any, join every solve but are never dropped or judged)."""
    n = len(y)
    used = np.ones(n, dtype=bool)
    coef = lstsq_with_prior(x, y, prior=prior)
    if method == "robust":
        for _ in range(8):
            r = y - x @ coef
            med = float(np.median(r[used]))
            mad = 1.4826 * float(np.median(np.abs(r[used] - med)))
            keep = np.abs(r - med) <= max(4 * mad, 0.03 * float(np.median(np.abs(y))))  # within 3%: never an outlier
            if keep.sum() <= x.shape[1] or (keep == used).all():
                break
            used = keep
            coef = lstsq_with_prior(x[used], y[used], prior=prior)
    elif method == "envelope":
        for _ in range(8):
            r = y - x @ coef
            # the lowest tenth (at least 3 points) in each third of the fitted values, so the
            # envelope spans the whole range
            third = np.argsort(np.argsort(x @ coef, kind="stable"), kind="stable") * 3 // n
            keep = np.zeros(n, dtype=bool)
            for b in range(3):
                idx = np.flatnonzero(third == b)
                low = idx[np.argsort(r[idx], kind="stable")[: max(3, math.ceil(0.1 * len(idx)))]]
                keep[low] = True
            if keep.sum() <= x.shape[1] or (keep == used).all():
                break
            used = keep
            coef = lstsq_with_prior(x[used], y[used], prior=prior)
    else:  # quantile regression by iteratively reweighted least squares
        eps = 1e-6 * float(np.mean(np.abs(y))) + 1e-15
        for _ in range(100):
            r = y - x @ coef
            w = np.where(r >= 0, q, 1 - q) / np.maximum(np.abs(r), eps)
            new = lstsq_with_prior(x, y, w, prior)
            done = np.allclose(new, coef, rtol=1e-7, atol=1e-15)
            coef = new
            if done:
                break
    return coef, used


def _uncertainty(
    x: np.ndarray,
    r: np.ndarray,
    q: float | None = None,
    scale: float = 1.0,
    floor: float = 0.0,
    total_weight: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Standard errors of the columns (σ²/RSS_j, RSS_j the residual of column j on the others; σ at
    least `floor` of `scale`) and how much of each column the others explain (R², centred when a
    constant column is among them).

    For a q-quantile regression σ is √(q(1−q)) / f(0), f the residuals' density at zero (a kernel
    estimate, its bandwidth at least 1e-4 of `scale`), the asymptotic scale of quantile regression.

    `total_weight`: the rows carry sample weights (folded into x and r as their square roots) that
    sum to this; σ² (least squares) is then the mean square over that many effective samples."""
    n, p = x.shape
    if q is None:
        dof = (n if total_weight is None else total_weight) - p
        sigma2 = float(np.sum((r - (r.mean() if n > p else 0.0)) ** 2)) / max(dof, 1)
    else:
        iqr = float(np.subtract(*np.percentile(r, [75, 25])))
        h = max(0.9 * min(float(np.std(r)), iqr / 1.34 if iqr > 0 else math.inf) * n**-0.2, 1e-4 * scale)
        dens = float(np.mean(np.abs(r) <= h)) / (2 * h) if h > 0 else 0.0
        sigma2 = q * (1 - q) / dens**2 * n / max(n - p, 1) if dens > 0 else math.inf
    sigma2 = max(sigma2, (floor * scale) ** 2)
    se, explained = np.full(p, math.inf), np.ones(p)
    const = [bool(np.ptp(x[:, j]) == 0) for j in range(p)]
    for j in range(p):
        xj, others = x[:, j], np.delete(x, j, axis=1)
        resid = xj - others @ lstsq_with_prior(others, xj) if p > 1 else xj
        rss = float(resid @ resid)
        centred = any(c for k, c in enumerate(const) if k != j)
        tss = float(np.sum((xj - xj.mean()) ** 2)) if centred else float(xj @ xj)
        explained[j] = 1.0 - rss / tss if tss > 0 else 1.0
        if rss > 1e-12 * float(xj @ xj):
            se[j] = math.sqrt(sigma2 / rss)
    return se, explained


@dataclass
class LinearFit:
    terms: dict[str, Term]
    samples: int
    used: int
    rel_rms: float
    condition: float
    """Condition number of the design with unit-norm columns (all candidate terms)."""


@dataclass
class _Pass:
    """One least-squares pass over the free columns."""

    free: list[int]
    x: np.ndarray
    """The free columns over the points the estimate rests on."""
    coef: np.ndarray
    used: np.ndarray
    se: np.ndarray
    explained: np.ndarray
    u: np.ndarray
    rel_rms: float
    identified: float = IDENTIFIED
    spread: float = math.nan
    """What judges whether the samples follow the model (`fit_linear`'s `scatter_of`)."""

    @property
    def failing(self) -> list[int]:
        return [k for k in range(len(self.free)) if not self.u[k] <= self.identified]


def fit_linear(
    x: np.ndarray,
    y: np.ndarray,
    names: list[str],
    priors: list[float],
    labels: list[str],
    what: str,
    method: Method,
    q: float = 0.5,
    noise_floor: float = 0.0,
    min_samples: int = 8,
    scatter: np.ndarray | None = None,
    weights: np.ndarray | None = None,
    prior_weight: float = 0.0,
    identified: float = IDENTIFIED,
    max_rel_rms: float = MAX_REL_RMS,
) -> LinearFit:
    """Fit y ≈ x·c term by term; unidentified terms keep their prior (see the module docstring).

    Columns come in order of precedence (the constant, then main terms, then secondary ones).
    When some term is not identified, the last column whose removal lets every other term be
    identified goes to its prior (so a secondary term collinear with a main one yields to it);
    if no single removal does, the least identified term does. `labels` name each column's
    regressor ("batch size"), `what` a sample ("TPOT"); residual scatter is taken as at least
    `noise_floor` of the median target. `scatter`, if given, is each sample's expected scatter
    (up to a factor): rows are divided by it, so precise samples weigh more (quantile and robust).

    `weights` (the online fitter's forgetting, 1 for a fresh sample) weigh each squared residual,
    and the residual scatter is judged over their sum; `prior_weight` > 0 adds the priors as that
    many pseudo-samples of the free terms (ridge toward the prior, see `prior_rows`): a term's
    relative departure from its prior costs as much as that relative error on a typical target
    (a term whose prior is 0, its contribution at its median regressor value), so terms the
    samples cannot tell apart move from their priors in proportion. Neither changes what counts
    as identified: that rests
    on the samples alone, so a prior cannot make its own term look fitted. `identified` is the
    largest relative uncertainty that counts as fitted (`IDENTIFIED` unless given); `max_rel_rms` the
largest relative residual of samples that follow the model (`MAX_REL_RMS` unless given: a caller
whose samples scatter more by construction, as the KV hand-off's step waits, says how much)."""
    n, p = x.shape
    norms = np.linalg.norm(x, axis=0)
    condition = float(np.linalg.cond(x / np.where(norms > 0, norms, 1.0))) if n >= p else math.inf
    fixed: dict[int, Term] = {}
    if n < min_samples:
        few = {
            names[j]: Term(
                names[j], priors[j], priors[j], f"prior: only {n} {what} samples (a fit needs {min_samples})", samples=n
            )
            for j in range(p)
        }
        return LinearFit(few, n, 0, math.nan, condition)
    scale = float(np.median(np.abs(y))) or 1.0
    w = np.ones(n) if scatter is None else 1.0 / np.maximum(scatter, 1e-12)
    w = w / float(np.median(w))
    scale_w = float(np.median(np.abs(y * w))) or 1.0
    if weights is not None:
        w = w * np.sqrt(np.maximum(weights, 0.0))
    omega = np.ones(n) if weights is None else np.maximum(weights, 0.0)
    typical = np.median(np.abs(x), axis=0)
    typical = np.where(typical > 0, typical, np.mean(np.abs(x), axis=0))
    typical = np.where(typical > 0, typical, 1.0)
    pull = np.array([scale / abs(v) if v != 0 else float(typical[j]) for j, v in enumerate(priors)])

    def rel_rms_of(r: np.ndarray, used: np.ndarray) -> float:
        if weights is None:
            return float(np.sqrt(np.mean(r[used] ** 2)) / (np.mean(np.abs(y[used])) or 1.0))
        om = omega[used]
        tot = float(om.sum()) or 1.0
        return float(np.sqrt(float(om @ r[used] ** 2) / tot) / ((float(om @ np.abs(y[used])) / tot) or 1.0))

    def scatter_of(r: np.ndarray, used: np.ndarray) -> float:
        """What judges whether the samples follow the model: the relative RMS residual, or for a
        quantile regression (fitted to ignore a one-sided tail: queueing only adds time) the
        residuals' robust scale (1.4826 MADs) relative to the median target, so the tail it is
        built to ignore cannot veto it."""
        if method != "quantile":
            return rel_rms_of(r, used)
        ru = r[used]
        mad = 1.4826 * float(np.median(np.abs(ru - np.median(ru)))) if len(ru) else 0.0
        return mad / (float(np.median(np.abs(y[used]))) or 1.0)

    def run(free: list[int]) -> _Pass:
        yt = y - sum((fixed[j].value * x[:, j] for j in fixed), np.zeros(n))
        xf = x[:, free]
        prior = prior_rows(pull[free], np.array([priors[j] for j in free]), prior_weight)
        coef, used = estimate(xf * w[:, None], yt * w, method, q, prior)
        r = yt - xf @ coef
        total = None if weights is None else float(omega[used].sum())
        se, _ = _uncertainty(
            (xf * w[:, None])[used], (r * w)[used], q if method == "quantile" else None, scale_w, noise_floor, total
        )
        _, explained = _uncertainty(xf[used], r[used])
        u = np.array([se[k] * float(np.median(np.abs(xf[used, k]))) / scale for k in range(len(free))])
        rel = rel_rms_of(r, used)
        return _Pass(free, xf[used], coef, used, se, explained, u, rel, identified, scatter_of(r, used))

    rel_rms, spread, used_n = math.nan, math.nan, 0
    while True:
        free = [j for j in range(p) if j not in fixed]
        if not free:
            yt = y - sum((fixed[j].value * x[:, j] for j in fixed), np.zeros(n))
            everyone = np.ones(n, dtype=bool)
            rel_rms, spread, used_n = rel_rms_of(yt, everyone), scatter_of(yt, everyone), n
            break
        f = run(free)
        rel_rms, spread, used_n = f.rel_rms, f.spread, int(f.used.sum())
        failing = f.failing
        if failing:
            drop = None
            for k in reversed(range(len(free))) if len(free) > 1 else ():
                if not run([j for j in free if j != free[k]]).failing:
                    drop = k
                    break
            if drop is None:
                drop = max(failing, key=lambda k: (float(f.u[k]) if math.isfinite(f.u[k]) else math.inf, k))
            why = _why(drop if drop in failing else failing[0], f, labels, what, identified)
            if drop not in failing:
                why = f"{labels[free[drop]]} yields to {labels[free[failing[0]]]}: {why}"
            j = free[drop]
            fixed[j] = Term(
                names[j], priors[j], priors[j], "prior: " + why, samples=n, used=used_n, rel_se=float(f.u[drop])
            )
            continue
        neg = [k for k in range(len(free)) if f.coef[k] < 0]
        if neg:
            k = min(neg, key=lambda k: f.coef[k] / max(f.se[k], 1e-300))
            fixed[free[k]] = Term(
                names[free[k]],
                0.0,
                priors[free[k]],
                f"fit: clipped at 0 (estimate {f.coef[k]:.3g} ± {f.se[k]:.2g})",
                samples=n,
                used=used_n,
                rel_se=float(f.u[k]),
            )
            continue
        for k, j in enumerate(free):
            fixed[j] = Term(names[j], float(f.coef[k]), priors[j], "fit", samples=n, used=used_n, rel_se=float(f.u[k]))
        break
    if spread > max_rel_rms and any(t.source.startswith("fit") for t in fixed.values()):
        # the samples do not follow the model (queueing, a host stall, another engine's timing):
        # no term of this regression is trusted, whatever its standard error says
        how = "robust relative scatter" if method == "quantile" else "relative residual"
        why = f"prior: the {what} samples do not follow the model ({how} {spread:.0%} > {max_rel_rms:.0%})"
        fixed = {
            j: Term(names[j], priors[j], priors[j], why, samples=n, used=used_n, rel_se=t.rel_se)
            if t.source.startswith("fit")
            else t
            for j, t in fixed.items()
        }
    for t in fixed.values():
        t.rel_rms = rel_rms
    return LinearFit({names[j]: fixed[j] for j in range(p)}, n, used_n, rel_rms, condition)


def _why(k: int, f: _Pass, labels: list[str], what: str, identified: float = IDENTIFIED) -> str:
    """Why column k of pass f is not identified."""
    xk = f.x[:, k]
    label = labels[f.free[k]]
    if np.ptp(xk) <= 1e-3 * float(np.mean(np.abs(xk))) and not (xk == 1).all():  # (the constant column is all ones)
        return f"{label} hardly varies in the run (all ≈ {float(np.mean(xk)):.4g}), so its cost is not identified"
    if f.explained[k] > 0.95:
        others = [labels[j] for j in f.free if j != f.free[k]]
        return (
            f"{label} moves with {' and '.join(others)} in the run (R² "
            f"{f.explained[k]:.3f}): their costs cannot be told apart"
        )
    u = float(f.u[k])
    return (
        f"too uncertain: ±{u * 100:.0f}% of a typical {what} (±{identified * 100:.0f}% or less counts as fitted)"
        if math.isfinite(u)
        else "not identified by the run"
    )


class Timeline:
    """Decode batch size and resident KV tokens on one instance, on a grid of `dt` seconds from `t0`.

    Each request is in the batch over [start, end) (from one step before its first token to its
    finish); its KV is its prompt until its first token, then grows by one token per step to
    prompt + output − 1 at its end. Steps are not evenly spaced in time (they lengthen as the
    batch grows), so `follow` places each request's tokens at the steps of a given step model:
    the steps taken up to t are ∫ dt / step(B, K), the same clock for every request on the
    instance. Before that, tokens are spread evenly in time."""

    def __init__(
        self, starts: np.ndarray, firsts: np.ndarray, ends: np.ndarray, prompts: np.ndarray, outputs: np.ndarray
    ) -> None:
        self.t0 = float(starts.min())
        self.dt = max(1e-3, (float(ends.max()) - self.t0) / 200_000)
        self.n = int(math.ceil((float(ends.max()) - self.t0) / self.dt)) + 1
        self.grid = self.t0 + self.dt * np.arange(self.n)
        self._i0, self._i1, self._i2 = self._at(starts), self._at(firsts), self._at(ends)
        self._prompts = prompts
        self._growth = np.maximum(outputs - 1, 0).astype(float)
        count = np.zeros(self.n + 1)
        np.add.at(count, self._i0, 1.0)
        np.add.at(count, self._i2, -1.0)
        self.batch = np.maximum(np.rint(np.cumsum(count)[: self.n]), 0.0)
        self.kv = self._kv(self.grid)

    def _at(self, t: np.ndarray) -> np.ndarray:
        """Index of the first grid point at or after t."""
        out: np.ndarray = np.clip(np.ceil((np.asarray(t) - self.t0) / self.dt - 1e-9).astype(int), 0, self.n)
        return out

    def _kv(self, clock: np.ndarray) -> np.ndarray:
        """Σ KV over the requests in the batch, each growing linearly in `clock` (a grid array)."""
        c = np.append(clock, clock[-1])
        c1, c2 = c[self._i1], c[self._i2]
        slope = np.where(c2 > c1, self._growth / np.where(c2 > c1, c2 - c1, 1.0), 0.0)
        a, s = np.zeros(self.n + 1), np.zeros(self.n + 1)
        np.add.at(a, self._i0, self._prompts)
        np.add.at(a, self._i1, -slope * c1)  # from the first token: prompt + slope·(clock − clock at first token)
        np.add.at(s, self._i1, slope)
        np.add.at(a, self._i2, -(self._prompts - slope * c1))
        np.add.at(s, self._i2, -slope)
        out: np.ndarray = np.maximum(np.cumsum(a)[: self.n] + np.cumsum(s)[: self.n] * clock, 0.0)
        return out

    def _weights(self, step: tuple[float, float, float]) -> np.ndarray:
        """Steps per second at each grid point (0 when idle)."""
        s0, s1, s2 = step
        return np.where(self.batch > 0, 1.0 / np.maximum(s0 + s1 * self.batch + s2 * self.kv, 1e-9), 0.0)

    def follow(self, step: tuple[float, float, float], rounds: int = 2) -> None:
        """Place the tokens at the steps of `step` = (s0, s1, s2) instead of evenly in time."""
        for _ in range(rounds):
            self.kv = self._kv(np.cumsum(self._weights(step)) * self.dt)

    def index(self, t: np.ndarray) -> np.ndarray:
        """Index of the grid point at or before t."""
        out: np.ndarray = np.clip(np.floor((np.asarray(t) - self.t0) / self.dt).astype(int), 0, self.n - 1)
        return out

    def at(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = self.index(t)
        return self.batch[i], self.kv[i]

    def step_means(
        self, starts: np.ndarray, ends: np.ndarray, step: tuple[float, float, float]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean batch and KV over the steps taken in each window [start, end): time-averaged with
        weight 1/step(B, K), since a stretch holds steps in proportion to its length over the step."""
        w = self._weights(step)
        cw = np.concatenate(([0.0], np.cumsum(w)))
        cb = np.concatenate(([0.0], np.cumsum(w * self.batch)))
        ck = np.concatenate(([0.0], np.cumsum(w * self.kv)))
        a = self.index(starts)
        b = np.maximum(self.index(ends), a + 1)
        tot = np.maximum(cw[b] - cw[a], 1e-12)
        return np.maximum((cb[b] - cb[a]) / tot, 1.0), (ck[b] - ck[a]) / tot

    def context_sums(self, step: tuple[float, float, float]) -> tuple[float, float]:
        """Σ K and Σ B over the instance's steps (for the resident KV per decoding request)."""
        w = self._weights(step)
        return float(np.sum(w * self.kv)), float(np.sum(w * self.batch))
