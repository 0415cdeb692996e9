"""Features a remaining-length predictor can use without the model's hidden states, and training samples.

The console sees a request's prompt length and how many tokens it has generated; from completed
requests of the same workload it knows the output-length survival function Ŝ. The features are
those, log-scaled, plus per-workload statistics conditioned on the request's age taken from Ŝ
(mean and median residual life, conditional survival a few horizons ahead), so a model trained on
one workload carries its length profile with it.

Samples follow the ARES predictor's data (spec §2.6): one point every `every` generated tokens
of every request (age a = 0, every, 2·every, … < L; target L − a), pooled over requests so long
requests weigh by their length, then subsampled uniformly.
"""

from __future__ import annotations

import numpy as np

from core.predict.survival import SurvivalPredictor

FEATURE_NAMES = (
    "log_prompt",
    "log_generated",
    "log_mean_residual",
    "log_median_residual",
    "survival",
    "p_alive_512",
    "p_alive_2048",
    "p_alive_8192",
)
"""Columns of `features`, in order."""

_AHEAD = (512.0, 2048.0, 8192.0)


def features(prompt: np.ndarray, generated: np.ndarray, survival: SurvivalPredictor) -> np.ndarray:
    """(n, len(FEATURE_NAMES)) float64 feature matrix."""
    p = np.asarray(prompt, dtype=float)
    g = np.asarray(generated, dtype=float)
    cols = [
        np.log1p(p),
        np.log1p(g),
        np.log1p(survival.mean_remaining(g)),
        np.log1p(survival.median_remaining(g)),
        survival.survival(g),
    ]
    cols.extend(survival.conditional(g, x) for x in _AHEAD)
    return np.stack(cols, axis=1)


def residual_samples(
    output: np.ndarray,
    *,
    every: int = 20,
    max_samples: int | None = None,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prediction points (request index, tokens generated, true remaining tokens).

    Every request of output length L contributes the points a = 0, every, … < L. With
    `max_samples` below their total, that many are drawn uniformly (with replacement) from the
    pooled points; otherwise all of them are returned in request order.
    """
    if every < 1:
        raise ValueError("every must be >= 1")
    out = np.asarray(output, dtype=np.int64)
    if np.any(out < 1):
        raise ValueError("output lengths must be >= 1")
    points = (out + every - 1) // every
    total = int(points.sum())
    if max_samples is None or max_samples >= total:
        req = np.repeat(np.arange(len(out)), points)
        starts = np.cumsum(points) - points
        k = np.arange(total) - np.repeat(starts, points)
    else:
        gen = rng if rng is not None else np.random.default_rng(0)
        req = gen.choice(len(out), size=max_samples, p=points / total)
        k = np.floor(gen.random(max_samples) * points[req]).astype(np.int64)
    age = k * every
    return req, age, out[req] - age
