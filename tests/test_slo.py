"""SLO maths: TTFT/TPOT, attainment, goodput, exact percentiles, sliding windows."""

from __future__ import annotations

import numpy as np
import pytest

from core.slo import LogHistogram, SlidingWindow, SLOClass, percentile, summarize, tpot


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert tpot(np.array([1.0, 2.0]), np.array([2.0, 2.0]), np.array([11, 1])).tolist() == [0.1, 0.0]


def test_percentile_is_exact_linear_interpolation() -> None:
    assert percentile(np.arange(1, 101, dtype=float), 99) == pytest.approx(99.01)
    assert np.isnan(percentile(np.array([]), 50))


def test_summary_by_hand() -> None:
    s = summarize(
        arrival=np.array([0.0, 0.0, 1.0, 2.0]),
        first_token=np.array([0.5, 3.0, 1.2, np.nan]),
        finish=np.array([1.5, 4.0, 3.2, np.nan]),
        output_tokens=np.array([11, 11, 11, 5]),
        ok=np.array([True, True, True, False]),
        slo=SLOClass(ttft_s=2.0, tpot_s=0.15),
    )
    # TTFT 0.5, 3.0, 0.2; TPOT 0.1, 0.1, 0.2. Met: only the first. Span 0 → 4.0 s, 33 tokens.
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["ttft_p50"] == pytest.approx(0.5)
    assert s["tpot_mean"] == pytest.approx(0.4 / 3)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["throughput_tok_s"] == pytest.approx(33 / 4.0)
    assert s["goodput_req_s"] == pytest.approx(1 / 4.0)


def test_sliding_window_forgets_old_samples_but_keeps_run_totals() -> None:
    w = SlidingWindow(window_s=10, slo={"default": SLOClass(), "tight": SLOClass(name="tight", ttft_s=0.1, tpot_s=0.01)})
    assert w.add(0.0, 0.5, 0.05, True) is True
    assert w.add(1.0, 0.5, 0.05, True, slo_class="tight") is False
    w.add(12.0, 3.0, 0.05, True)
    snap = w.snapshot(12.5)
    assert snap["window"]["requests"] == 1 and snap["window"]["attainment"] == 0.0
    assert snap["run"]["requests"] == 3 and snap["run"]["attainment"] == pytest.approx(1 / 3)


def test_sliding_window_percentiles_stay_within_a_bin_and_memory_stays_flat() -> None:
    rng = np.random.default_rng(3)
    w = SlidingWindow(window_s=10)
    ttfts = rng.lognormal(-1.0, 1.0, 20_000)
    for k, x in enumerate(ttfts):
        w.add(k * 0.001, float(x), 0.02, True)  # 20 s of samples: the window keeps the last 10
    snap = w.snapshot(20.0)
    err = LogHistogram.BIN_ERROR
    assert snap["run"]["ttft_p99"] == pytest.approx(float(np.percentile(ttfts, 99, method="inverted_cdf")), rel=err)
    assert snap["window"]["ttft_p50"] == pytest.approx(float(np.percentile(ttfts[10_000:], 50, method="inverted_cdf")), rel=err)
    assert snap["window"]["requests"] == 10_000 and snap["window"]["attainment"] == pytest.approx(
        float(np.mean(ttfts[10_000:] <= 2.0)))
    assert w._run_ttft.counts.nbytes == LogHistogram.BINS * 8  # no list grows with the run
