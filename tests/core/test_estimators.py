"""The survival, prefill-time and decode-rate estimators."""

from __future__ import annotations

import numpy as np
import pytest

from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from tests.helpers import toy_profile


def test_survival_prior_is_uniform_and_interpolates() -> None:
    s = SurvivalEstimator(delta=100, alpha=0.5, max_len=1000)
    assert s(0) == 1.0
    assert s(np.array([100, 150, 1000, 5000])) == pytest.approx([0.9, 0.85, 0.0, 0.0])


def test_survival_update_moves_every_bucket() -> None:
    s = SurvivalEstimator(delta=100, alpha=0.5, max_len=1000, fold_every=1)
    s.observe(150)
    # Ŝ(l) ← 0.5·Ŝ(l) + 0.5·[150 ≥ l]: buckets at 100 rise, buckets above 150 fall.
    assert s(100) == pytest.approx(0.5 * 0.9 + 0.5)
    assert s(200) == pytest.approx(0.5 * 0.8)
    assert s(0) == 1.0


def test_survival_converges_to_the_empirical_tail() -> None:
    rng = np.random.default_rng(0)
    s = SurvivalEstimator(delta=64, alpha=0.99, max_len=8192)
    lengths = rng.exponential(1000, 5000)
    for x in lengths:
        s.observe(x)
    s.flush()
    assert s(1000) == pytest.approx(np.exp(-1), abs=0.06)
    assert s(3000) == pytest.approx(np.exp(-3), abs=0.03)


def test_survival_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        SurvivalEstimator(delta=0)
    with pytest.raises(ValueError):
        SurvivalEstimator(alpha=1.0)


def test_prefill_fit_starts_at_the_profile_and_learns_the_truth() -> None:
    prof = toy_profile(prefill_base_s=0.01, prefill_per_token_s=0.001)
    est = PrefillTimeEstimator(prof, refit_every=1)
    assert est(100) == pytest.approx(0.11)
    for n in np.tile(np.arange(1, 2000, 7), 10):  # the real machine is twice as slow per token, plus a quadratic term
        est.observe(n, 0.02 + 0.002 * n + 1e-7 * n * n)
    assert est(500) == pytest.approx(0.02 + 1.0 + 0.025, rel=0.03)


def test_decode_rate_is_an_ema_of_completed_rates() -> None:
    r = DecodeRateEstimator(prior=10.0, alpha=0.5)
    r.observe(tokens=21, seconds=1.0)  # 20 inter-token gaps in 1 s
    assert r.value == pytest.approx(15.0)
    r.observe(tokens=1, seconds=1.0)  # single-token requests say nothing about the rate
    assert r.value == pytest.approx(15.0)


def test_batched_survival_updates_equal_one_by_one_updates() -> None:
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 9000, 300)
    batched = SurvivalEstimator(delta=64, alpha=0.97, max_len=8192, fold_every=1000)
    for x in lengths:
        batched.observe(float(x))
    batched.flush()
    one_by_one = SurvivalEstimator(delta=64, alpha=0.97, max_len=8192, fold_every=1)
    for x in lengths:
        one_by_one.observe(float(x))
        one_by_one(0)  # a query folds each observation in on its own
    grid = np.arange(0, 8300, 37)
    assert batched(grid) == pytest.approx(one_by_one(grid))
    # and both equal the textbook recurrence
    ref = np.clip(1 - batched.grid / 8192, 0, 1)
    for x in lengths:
        ref = 0.97 * ref + 0.03 * (batched.grid <= x)
        ref[0] = 1.0
    assert batched.values == pytest.approx(ref)


def test_survival_integrals_match_the_curve() -> None:
    from core.estimators import SurvivalEstimator

    sv = SurvivalEstimator(delta=100, max_len=1000, prior_max=1000)
    x = np.array([0.0, 10.0, 500.0, 999.5, 1000.0])
    assert np.allclose(sv.integral_at(x), x - x * x / 2000, atol=1e-3)
    assert np.allclose(sv.integral_at(x, moment=True), x**2 / 2 - x**3 / 3000, rtol=1e-3, atol=0.5)
    assert sv.mean_length() == pytest.approx(500.0)
