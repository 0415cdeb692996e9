"""γ-Boost's building blocks: the boost function, MemGuard binning and γ-Ada (spec:
shared/design/papers/tail-aware.md §2.2, §2.6, §2.7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from core.policies.gamma import LN5, GammaAda, GammaAdaParams, boost, quantize

# τ = 1 ms/token, k = 256 → τk = 0.256 s.
TAU, K = 0.001, 256


def test_boost_function_values_and_shape() -> None:
    # f(u) = ln(1/(1−e^{−u})): spec §2.2 table
    for u, f in (
        (0.01, 4.61),
        (0.1, 2.35),
        (0.5, 0.933),
        (1.0, 0.459),
        (2.0, 0.145),
        (5.0, 0.0068),
    ):
        assert boost(u, 1.0) == pytest.approx(f, rel=7e-3)  # table rounded to 3 digits
    assert boost(0.0, 1.0) == math.inf
    assert boost(1.0, 2.0) == pytest.approx(boost(2.0, 1.0) / 2)  # scale-free: f(γx)/γ
    xs = [0.01, 0.1, 1.0, 10.0]
    assert all(boost(x, 1.0) > boost(y, 1.0) for x, y in zip(xs, xs[1:], strict=False))


def test_memguard_binning_is_the_floor_quantiser() -> None:
    cases = {1: 256, 255: 256, 511: 256, 512: 512, 1023: 512, 1024: 1024, 2047: 1024, 10_000: 8192}
    assert {w: quantize(w, 256) for w in cases} == cases
    # "a 10k-token request has at most 6 revision points" with k = 256 (spec §2.6)
    assert len({quantize(w, 256) for w in range(1, 10_001)}) == 6
    assert quantize(100, 64) == 64 and quantize(130, 64) == 128


def _ada(**kw: object) -> GammaAda:
    base = {"min_samples": 50, "update_every": 50, "update_min_interval_s": 0.0, "window_s": 1e9}
    return GammaAda(GammaAdaParams.model_validate({**base, **kw}))


def test_gamma_ada_moves_the_right_way_and_matches_eq9() -> None:
    g0 = 1.0 / (TAU * K)
    narrow, wide = _ada(), _ada()
    for i in range(200):
        narrow.observe(float(i), 10.0 + 0.001 * i)  # t99 − t95 ≈ 0.008 s → floored at ε
        wide.observe(float(i), float(i))  # t99 − t95 = 7.96 s
    assert narrow.update(200.0, TAU) and wide.update(200.0, TAU)
    assert narrow.gamma(TAU) > g0 > wide.gamma(TAU)  # light tail → FCFS-ward, wide → LAS-ward
    assert narrow.gamma(TAU) == pytest.approx(0.8 * g0 + 0.2 * LN5 / 0.01)
    x95, x99 = np.percentile(np.arange(200.0), [95, 99])
    assert wide.gamma(TAU) == pytest.approx(0.8 * g0 + 0.2 * LN5 / (x99 - x95))
    # clipped to u_k = γτk ∈ [u_min, u_max]
    clip = _ada(u_max=2.0)
    for i in range(200):
        clip.observe(float(i), 10.0)
    clip.update(200.0, TAU)
    assert clip.gamma(TAU) == pytest.approx(2.0 / (TAU * K))


def test_gamma_ada_waits_for_samples_count_and_interval() -> None:
    ada = _ada(update_min_interval_s=5.0, window_s=10.0)
    for i in range(49):
        ada.observe(0.1 * i, 1.0 + i)
    assert not ada.update(4.9, TAU)  # 49 < update_every
    ada.observe(4.95, 3.0)
    assert ada.update(5.0, TAU) and ada.updates == 1
    for i in range(50):
        ada.observe(5.0 + 0.01 * i, 2.0)
    assert not ada.update(5.5, TAU)  # < 5 s since the last update
    assert not ada.update(30.0, TAU)  # the 10-s window holds no sample any more
    with pytest.raises(ValidationError):
        GammaAdaParams(u_min=1.0, u_init=0.5)
