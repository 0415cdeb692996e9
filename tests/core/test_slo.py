"""SLO maths: TTFT/TPOT, attainment, goodput, exact percentiles, sliding windows."""

from __future__ import annotations

import numpy as np
import pytest

from core.slo import LogHistogram, SlidingWindow, SLOClass, met, percentile, summarize, tpot


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
    w = SlidingWindow(
        window_s=10, slo={"default": SLOClass(), "tight": SLOClass(name="tight", ttft_s=0.1, tpot_s=0.01)}
    )
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
    assert snap["window"]["ttft_p50"] == pytest.approx(
        float(np.percentile(ttfts[10_000:], 50, method="inverted_cdf")), rel=err
    )
    assert snap["window"]["requests"] == 10_000 and snap["window"]["attainment"] == pytest.approx(
        float(np.mean(ttfts[10_000:] <= 2.0))
    )
    assert w._run_ttft.counts.nbytes == LogHistogram.BINS * 8  # no list grows with the run


def test_an_unmeasured_tpot_is_left_out_of_tpot_attainment_and_judged_on_ttft() -> None:
    """A whole (non-streamed) reply has no TPOT: it counts in neither side of TPOT attainment nor
    in the TPOT percentiles, and meets its SLO on TTFT alone; a failed request still counts everywhere."""
    w = SlidingWindow(window_s=10, slo={"default": SLOClass(ttft_s=1.0, tpot_s=0.1)})
    assert w.add(0.0, 0.5, None, True) is True  # whole reply, TTFT met
    assert w.add(0.1, 1.5, None, True) is False  # whole reply, TTFT missed
    assert w.add(0.2, 0.5, 0.2, True) is False  # streamed, TPOT missed
    assert w.add(0.3, 0.5, 0.05, True) is True  # streamed, all met
    assert w.add(0.4, None, None, False) is False  # failed
    for span in (w.snapshot(1.0)["window"], w.snapshot(1.0)["run"]):
        assert span["requests"] == 5 and span["tpot_unknown"] == 2
        assert span["attainment"] == pytest.approx(2 / 5)
        assert span["ttft_attainment"] == pytest.approx(3 / 5)
        assert span["tpot_attainment"] == pytest.approx(1 / 3)  # two streamed and the failure
        assert span["tpot_p99"] == pytest.approx(0.2, rel=LogHistogram.BIN_ERROR)
    only_whole = SlidingWindow(window_s=10)
    only_whole.add(0.0, 0.5, None, True)
    snap = only_whole.snapshot(1.0)["window"]
    assert snap["tpot_attainment"] is None and snap["tpot_p50"] is None and snap["attainment"] == 1.0
    later = w.snapshot(20.0)["window"]  # the window forgets them again
    assert later["requests"] == 0 and later["tpot_unknown"] == 0 and later["tpot_attainment"] is None


def test_met_judges_a_nan_latency_on_what_is_known() -> None:
    ttft_s = np.array([0.5, 3.0, 0.5, np.nan])
    tpot_s = np.array([np.nan, np.nan, 0.5, 0.05])
    ok = np.array([True, True, True, False])
    assert met(ttft_s, tpot_s, ok).tolist() == [True, False, False, False]
    assert met(np.array([0.5]), np.array([0.05]), np.array([True])).tolist() == [True]
