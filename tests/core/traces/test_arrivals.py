"""Poisson and gamma arrivals at the asked rate, and the index of dispersion that tells them apart."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.errors import TraceError
from core.traces import gamma_arrivals, index_of_dispersion, poisson_arrivals


def test_poisson_and_gamma_arrivals() -> None:
    rng = np.random.default_rng(9)
    poisson = poisson_arrivals(40_000, 20.0, rng)
    gamma1 = gamma_arrivals(40_000, 20.0, 1.0, np.random.default_rng(9))
    bursty = gamma_arrivals(40_000, 20.0, 0.25, np.random.default_rng(9))
    smooth = gamma_arrivals(40_000, 20.0, 4.0, np.random.default_rng(9))
    for arr in (poisson, gamma1, bursty, smooth):
        assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
        assert (len(arr) - 1) / arr[-1] == pytest.approx(20.0, rel=0.05)
    d_poisson = index_of_dispersion(poisson)
    assert d_poisson == pytest.approx(1.0, abs=0.15)
    assert index_of_dispersion(gamma1) == pytest.approx(1.0, abs=0.15)
    # gamma shape k: gap CV^2 = 1/k, so counts have dispersion about 1/k
    assert index_of_dispersion(bursty) == pytest.approx(4.0, rel=0.25)
    assert index_of_dispersion(bursty) > 2 * d_poisson > 2 * index_of_dispersion(smooth)
    assert gamma_arrivals(5, math.inf, 1.0, rng).tolist() == [0.0] * 5
    assert len(poisson_arrivals(0, 1.0, rng)) == 0
    with pytest.raises(TraceError):
        poisson_arrivals(3, 0.0, rng)
    with pytest.raises(TraceError):
        gamma_arrivals(3, 1.0, 0.0, rng)
