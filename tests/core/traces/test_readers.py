"""Tests for core.traces: real-trace readers, ServeGen sampling, synthetic workloads, Trace ops.

The real-trace tests run on small unmodified slices of the real traces kept in
tests/data/traces/ (see its README.md for sources, licences and how each slice was cut); the
expected numbers were computed by hand from those slices. The tests marked ``needs_shared``
re-check the readers on the complete traces in ../shared/traces when that folder exists.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import re
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from core.errors import TraceError
from core.traces import (
    FORMATS,
    OUTPUT_CAP,
    WORKLOADS,
    Trace,
    detect_format,
    gamma_arrivals,
    index_of_dispersion,
    poisson_arrivals,
    read_trace,
    synthetic_lengths,
    synthetic_trace,
)
from core.types import Request

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"
DATA = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE = SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = SHARED / "mooncake_fast25" / "conversation_trace.jsonl"
MOONCAKE_SYN = SHARED / "mooncake_fast25" / "synthetic_trace.jsonl"
SERVEGEN = SHARED / "servegen_deepseek_r1"
SERVEGEN_SAMPLE = DATA / "servegen_sample"
# committed slices of the real traces (first rows / a few whole ServeGen clients)
AZURE_SLICE = DATA / "azure_conv_first1000.csv"
MOONCAKE_CONV_SLICE = DATA / "mooncake_conversation_first500.jsonl"
MOONCAKE_SYN_SLICE = DATA / "mooncake_synthetic_first500.jsonl"
SERVEGEN_SLICE = DATA / "servegen_deepseek_r1_slice"
SERVEGEN_SLICE_CLIENTS = (25, 33, 39)

needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=f"optional full-trace check: {SHARED} is absent (the slices under tests/data cover it)",
)


def _timed_read(path: Path, **kwargs: object) -> tuple[Trace, float]:
    t0 = time.perf_counter()
    trace = read_trace(path, **kwargs)  # type: ignore[arg-type]
    return trace, time.perf_counter() - t0


def _origin(trace: Trace) -> float:
    """Where a ServeGen sample's arrival 0 sits in the trace day (recorded in ``source``)."""
    match = re.search(r"arrival 0 is t=([0-9.]+)s", trace.source)
    assert match is not None, trace.source
    return float(match.group(1))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _servegen_rates(folder: Path) -> dict[int, np.ndarray]:
    """client id -> array of (window start, rate) rows, read independently of the module."""
    out: dict[int, np.ndarray] = {}
    for path in folder.glob("chunk-*-trace.csv"):
        with path.open() as fh:
            rows = [(float(r[0]), float(r[1]) if r[3] else 0.0) for r in csv.reader(fh)]
        out[int(path.name.split("-")[1])] = np.array(rows)
    return out


def _pmf(folder: Path, client: int, window: str, field: str) -> dict[int, float]:
    """One PMF of a ServeGen dataset file, parsed independently of the module."""
    data = json.loads((folder / f"chunk-{client}-dataset.json").read_text())
    return ast.literal_eval(data[window][field])  # type: ignore[no-any-return]


def _pmf_mean(pmf: dict[int, float]) -> float:
    return sum(k * p for k, p in pmf.items()) / sum(pmf.values())


# -- Azure 2023 conversation trace: its first 1,000 rows ---------------------------------------


def test_azure_slice_counts_sums_extremes_and_first_rows() -> None:
    assert detect_format(AZURE_SLICE) == "azure"
    trace = read_trace(AZURE_SLICE)
    assert trace.name == "azure:azure_conv_first1000.csv"
    assert len(trace) == 1_000 and trace.hash_ids is None and trace.skipped == 0
    # rows 1-5: 18:15:46.6805900 374/44, 18:15:50.9951690 396/109, 18:15:51.2224670 879/55, ...
    assert np.allclose(trace.arrivals[:4], [0.0, 4.314579, 4.541877, 4.710427], atol=1e-9, rtol=0)
    assert trace.prompt_tokens[:5].tolist() == [374, 396, 879, 91, 91]
    assert trace.output_tokens[:5].tolist() == [44, 109, 55, 16, 16]
    # last row: 2023-11-16 18:19:22.7079830,309,18
    assert trace.arrivals[-1] == pytest.approx(216.027393, abs=1e-7)
    assert (trace.prompt_tokens[-1], trace.output_tokens[-1]) == (309, 18)
    # strictly increasing (smallest gap 6 us); the largest gap is the first one
    gaps = np.diff(trace.arrivals)
    assert gaps.min() == pytest.approx(6e-6, abs=1e-8)
    assert gaps.max() == pytest.approx(4.314579, abs=1e-8) and int(np.argmax(gaps)) == 0
    assert int(trace.prompt_tokens.sum()) == 1_014_189
    assert (trace.prompt_tokens.min(), trace.prompt_tokens.max()) == (2, 4_145)
    assert int(np.argmax(trace.prompt_tokens)) == 977
    assert int(trace.output_tokens.sum()) == 247_262
    assert (trace.output_tokens.min(), trace.output_tokens.max()) == (12, 1_000)
    assert int(np.sum(trace.output_tokens == 1_000)) == 1
    s = trace.summary()
    assert s["count"] == 1_000 and s["span_s"] == pytest.approx(216.027393, abs=1e-7)
    assert s["mean_rate"] == pytest.approx(999 / 216.027393, rel=1e-9)
    assert s["prompt_mean"] == pytest.approx(1_014.189) and s["prompt_p50"] == 999.0
    assert s["output_mean"] == pytest.approx(247.262) and s["output_p50"] == 203.0
    assert s["prompt_max"] == 4_145 and s["output_max"] == 1_000


def test_azure_slice_matches_an_independent_parse_to_100ns() -> None:
    with AZURE_SLICE.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1_000

    def seconds(stamp: str) -> Decimal:  # all rows are on 2023-11-16
        day, clock = stamp.split(" ")
        assert day == "2023-11-16"
        h, m, s = clock.split(":")
        return Decimal(int(h) * 3600 + int(m) * 60) + Decimal(s)

    stamps = [seconds(r["TIMESTAMP"]) for r in rows]
    expected = [float(s - stamps[0]) for s in stamps]
    trace = read_trace(AZURE_SLICE, "azure")
    assert np.allclose(trace.arrivals, expected, atol=1e-8, rtol=0)
    assert trace.prompt_tokens.tolist() == [int(r["ContextTokens"]) for r in rows]
    assert trace.output_tokens.tolist() == [int(r["GeneratedTokens"]) for r in rows]


def test_read_trace_limit_keeps_the_first_rows() -> None:
    full = read_trace(AZURE_SLICE)
    head = read_trace(AZURE_SLICE, limit=100)
    assert len(head) == 100
    assert np.array_equal(head.arrivals, full.arrivals[:100])
    assert np.array_equal(head.prompt_tokens, full.prompt_tokens[:100])
    assert np.array_equal(head.output_tokens, full.output_tokens[:100])
    assert len(read_trace(MOONCAKE_CONV_SLICE, limit=7)) == 7
    all_ids = read_trace(MOONCAKE_CONV_SLICE).hash_ids
    assert all_ids is not None
    assert read_trace(MOONCAKE_CONV_SLICE, limit=7).hash_ids == all_ids[:7]
    assert len(read_trace(AZURE_SLICE, limit=5_000)) == 1_000


# -- Mooncake FAST'25 traces: the first 500 rows of each -----------------------------------------


def test_mooncake_conversation_slice_batches_lengths_and_hash_ids() -> None:
    assert detect_format(MOONCAKE_CONV_SLICE) == "mooncake"
    trace = read_trace(MOONCAKE_CONV_SLICE)
    assert trace.name == "mooncake:mooncake_conversation_first500.jsonl"
    assert len(trace) == 500 and "re-sorted" not in trace.source
    # coarse timestamps: 10 rows at 0 ms, then batches 2,999-3,001 ms apart up to 165,000 ms
    assert trace.arrivals[:11].tolist() == [0.0] * 10 + [3.0]
    assert trace.arrivals[-1] == 165.0 and trace.span_s == 165.0
    assert len(np.unique(trace.arrivals)) == 56
    gaps = np.round(np.diff(trace.arrivals) * 1000).astype(int)
    assert set(gaps.tolist()) == {0, 2_999, 3_000, 3_001}
    assert int(np.sum(gaps > 0)) == 55
    # per-second counts over 166 bins: sum 500, sum of squares 5,070 -> variance / mean
    mean = 500 / 166
    assert index_of_dispersion(trace.arrivals) == pytest.approx((5_070 / 166 - mean**2) / mean)
    assert index_of_dispersion(trace.arrivals) == pytest.approx(7.128, abs=1e-3)
    assert int(trace.prompt_tokens.sum()) == 7_124_855
    assert (trace.prompt_tokens.min(), trace.prompt_tokens.max()) == (892, 121_298)
    assert int(trace.output_tokens.sum()) == 180_942
    assert (trace.output_tokens.min(), trace.output_tokens.max()) == (1, 2_000)
    assert trace.prompt_tokens[:3].tolist() == [6_758, 7_322, 7_236]
    assert trace.output_tokens[:3].tolist() == [500, 490, 794]
    assert (trace.prompt_tokens[-1], trace.output_tokens[-1]) == (15_597, 138)
    # hash ids kept: ceil(input / 512) blocks per row; shared prefixes start with block 0
    assert trace.hash_ids is not None
    assert trace.hash_ids[0] == list(range(14))
    assert trace.hash_ids[1] == [0, *range(14, 28)]
    blocks = np.array([len(h) for h in trace.hash_ids])
    assert np.array_equal(blocks, -(-trace.prompt_tokens // 512))
    assert int(blocks.sum()) == 14_162
    assert len({h for ids in trace.hash_ids for h in ids}) == 11_879


def test_mooncake_synthetic_slice() -> None:
    trace = read_trace(MOONCAKE_SYN_SLICE, "mooncake")
    assert len(trace) == 500
    # timestamps 0, 0, 40, 277, 471 ms ... 139,272 ms; only the first two coincide
    assert trace.arrivals[:5].tolist() == [0.0, 0.0, 0.04, 0.277, 0.471]
    assert trace.span_s == pytest.approx(139.272)
    assert len(np.unique(trace.arrivals)) == 499
    assert index_of_dispersion(trace.arrivals) == pytest.approx(1.1166, abs=1e-4)
    assert int(trace.prompt_tokens.sum()) == 6_403_130
    assert (trace.prompt_tokens.min(), trace.prompt_tokens.max()) == (13, 134_773)
    assert int(trace.output_tokens.sum()) == 97_659
    assert (trace.output_tokens.min(), trace.output_tokens.max()) == (1, 811)
    assert trace.prompt_tokens[:3].tolist() == [40_160, 36_640, 23_769]
    assert trace.output_tokens[:3].tolist() == [6, 4, 3]
    assert trace.hash_ids is not None
    assert trace.hash_ids[1][:3] == [79, 80, 81] and len(trace.hash_ids[0]) == 79
    assert sum(len(h) for h in trace.hash_ids) == 12_833
    assert len({h for ids in trace.hash_ids for h in ids}) == 11_749


def test_mooncake_slices_match_an_independent_parse() -> None:
    for path in (MOONCAKE_CONV_SLICE, MOONCAKE_SYN_SLICE):
        rows = _jsonl(path)
        trace = read_trace(path)
        assert trace.arrivals.tolist() == [r["timestamp"] / 1000 for r in rows]
        assert trace.prompt_tokens.tolist() == [r["input_length"] for r in rows]
        assert trace.output_tokens.tolist() == [r["output_length"] for r in rows]
        assert trace.hash_ids == [r["hash_ids"] for r in rows]


# -- ServeGen DeepSeek-R1: three whole clients (25, 33, 39) of the real folder -----------------


def test_servegen_slice_default_range_is_client_39_only_and_seeded() -> None:
    assert detect_format(SERVEGEN_SLICE) == "servegen"
    assert detect_format(SERVEGEN_SLICE / "chunk-33-trace.csv") == "servegen"
    assert detect_format(SERVEGEN_SLICE / "chunk-33-dataset.json") == "servegen"
    rates = _servegen_rates(SERVEGEN_SLICE)
    assert sorted(rates) == list(SERVEGEN_SLICE_CLIENTS)
    assert all(len(r) == 144 for r in rates.values())  # 24 h of 600-s windows
    # 0-600 s: only client 39 has traffic (0.4183/s, Weibull with CV 7.2)
    assert [c for c, r in rates.items() if r[0, 1] > 0] == [39]
    trace = read_trace(SERVEGEN_SLICE)  # default: seed 0, start 0, 600 s
    assert trace.name == "servegen:servegen_deepseek_r1_slice"
    assert "clients=all (3)" in trace.source
    assert 100 < len(trace) < 500  # 251 expected; bursty
    assert trace.arrivals[0] == 0.0 and np.all(np.diff(trace.arrivals) >= 0)
    assert _origin(trace) >= 0.0 and _origin(trace) + trace.span_s < 600.0
    only39 = read_trace(SERVEGEN_SLICE, servegen_clients=["chunk-39"])
    assert "clients=39 (1)" in only39.source
    for col in ("arrivals", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(trace, col), getattr(only39, col))
    assert set(trace.prompt_tokens.tolist()) <= set(_pmf(SERVEGEN_SLICE, 39, "0", "input_tokens"))
    assert set(trace.output_tokens.tolist()) <= set(_pmf(SERVEGEN_SLICE, 39, "0", "output_tokens"))
    again = read_trace(SERVEGEN_SLICE, seed=0)
    other = read_trace(SERVEGEN_SLICE, seed=1)
    assert np.array_equal(trace.arrivals, again.arrivals)
    assert np.array_equal(trace.output_tokens, again.output_tokens)
    assert len(trace) != len(other) or not np.array_equal(trace.arrivals, other.arrivals)
    assert np.array_equal(read_trace(SERVEGEN_SLICE, limit=10).arrivals, trace.arrivals[:10])


def test_servegen_slice_day_counts_follow_the_csv_rates() -> None:
    rates = _servegen_rates(SERVEGEN_SLICE)
    # by hand from the three CSVs: 14 windows with traffic, sum(rate x 600) = 18,298 requests
    active = {0, 600, 1_200, 35_400, 49_200, 49_800, *range(55_200, 60_000, 600)}
    assert {int(s) for r in rates.values() for s, rate in r if rate > 0} == active
    assert sum(float(r[:, 1].sum()) * 600 for r in rates.values()) == pytest.approx(18_298)
    day, elapsed = _timed_read(SERVEGEN_SLICE, seed=1, servegen_duration_s=86_400)
    assert elapsed < 2.0
    assert len(day) == pytest.approx(18_298, rel=0.06)
    # every arrival is inside a window that has traffic (1 ms slack: origin printed to 1 ms)
    t = day.arrivals + _origin(day)
    assert {int(w) * 600 for w in np.unique((t + 1e-3) // 600)} <= active
    # client 33's four steady midday windows (Gamma, CV ~1): 6.0617, 5.2383, 5.49, 5.0667 req/s
    busy = {57_000: 3_637, 57_600: 3_143, 58_200: 3_294, 58_800: 3_040}
    for start, n in busy.items():
        assert float(rates[33][rates[33][:, 0] == start, 1][0]) * 600 == pytest.approx(n, abs=0.5)
    one = read_trace(
        SERVEGEN_SLICE,
        seed=1,
        servegen_clients=["33"],
        servegen_start_s=57_000,
        servegen_duration_s=2_400,
    )
    t = one.arrivals + _origin(one)
    assert t.min() >= 57_000 - 1e-3 and t.max() < 59_400
    counts = np.bincount(((t + 1e-3 - 57_000) // 600).astype(int), minlength=4)
    assert len(counts) == 4
    for count, n in zip(counts.tolist(), busy.values(), strict=True):
        assert count == pytest.approx(n, rel=0.06)


def test_servegen_slice_lengths_follow_the_six_hour_window_pmf() -> None:
    # client 25: traffic at 35,400 s (dataset window "21600") and 49,200-50,400 s ("43200")
    early_in = _pmf(SERVEGEN_SLICE, 25, "21600", "input_tokens")
    late_in = _pmf(SERVEGEN_SLICE, 25, "43200", "input_tokens")
    early_out = _pmf(SERVEGEN_SLICE, 25, "21600", "output_tokens")
    late_out = _pmf(SERVEGEN_SLICE, 25, "43200", "output_tokens")
    assert (len(early_in), min(early_in), max(early_in)) == (40, 62, 156)
    assert (len(late_in), min(late_in), max(late_in)) == (32, 62, 266)
    trace = read_trace(
        SERVEGEN_SLICE,
        seed=2,
        servegen_clients=["25"],
        servegen_start_s=35_400,
        servegen_duration_s=15_000,
    )
    assert _origin(trace) == pytest.approx(35_400, abs=600)
    t = trace.arrivals + _origin(trace)
    early = t < 36_000
    late = t >= 49_200 - 1e-3
    assert np.all(early | late)
    assert early.sum() > 50 and late.sum() > 100
    assert set(trace.prompt_tokens[early].tolist()) <= set(early_in)
    assert set(trace.output_tokens[early].tolist()) <= set(early_out)
    assert set(trace.prompt_tokens[late].tolist()) <= set(late_in)
    assert set(trace.output_tokens[late].tolist()) <= set(late_out)
    # 25.7 % of the "21600" input mass lies outside the "43200" support: the window matters
    outside = np.isin(trace.prompt_tokens[early], list(late_in), invert=True)
    assert 0.1 < outside.mean() < 0.45
    # client 33, one 6-h window ("43200"), ~16k requests: sample means track the PMF means
    busy = read_trace(
        SERVEGEN_SLICE,
        seed=3,
        servegen_clients=["33"],
        servegen_start_s=55_200,
        servegen_duration_s=4_800,
    )
    pmf_in = _pmf(SERVEGEN_SLICE, 33, "43200", "input_tokens")
    pmf_out = _pmf(SERVEGEN_SLICE, 33, "43200", "output_tokens")
    assert _pmf_mean(pmf_in) == pytest.approx(269.735, abs=1e-3)
    assert _pmf_mean(pmf_out) == pytest.approx(358.338, abs=1e-3)
    assert len(busy) > 15_000
    assert set(busy.prompt_tokens.tolist()) <= set(pmf_in)
    assert set(busy.output_tokens.tolist()) <= set(pmf_out)
    assert (busy.prompt_tokens.min(), busy.prompt_tokens.max()) == (89, 1_130)
    assert busy.prompt_tokens.mean() == pytest.approx(269.735, rel=0.03)
    assert busy.output_tokens.mean() == pytest.approx(358.338, rel=0.03)


def test_servegen_slice_single_client_file_range_and_errors() -> None:
    # a chunk-<id>-trace.csv path selects that client of its folder
    one = read_trace(SERVEGEN_SLICE / "chunk-25-trace.csv", servegen_start_s=35_400)
    assert "clients=25 (1)" in one.source and len(one) > 0
    assert set(one.prompt_tokens.tolist()) <= set(_pmf(SERVEGEN_SLICE, 25, "21600", "input_tokens"))
    assert len(read_trace(SERVEGEN_SLICE / "chunk-25-trace.csv")) == 0  # no traffic at 0-600 s
    # a sub-range samples exactly the requests the whole day has in it
    whole = read_trace(SERVEGEN_SLICE, seed=4, servegen_duration_s=86_400)
    part = read_trace(SERVEGEN_SLICE, seed=4, servegen_start_s=57_600, servegen_duration_s=600)
    t = whole.arrivals + _origin(whole)
    sel = (t >= 57_600) & (t < 58_200)
    assert sel.sum() == len(part) > 2_000
    assert np.allclose(t[sel], part.arrivals + _origin(part), atol=2e-3)
    assert np.array_equal(whole.output_tokens[sel], part.output_tokens)
    with pytest.raises(TraceError, match=r"unknown ServeGen client '3'.*clients 25\.\.39 \(3 "):
        read_trace(SERVEGEN_SLICE, servegen_clients=["3"])
    with pytest.raises(TraceError, match=r"past the end of the trace \(86400 s\)"):
        read_trace(SERVEGEN_SLICE, servegen_start_s=86_400)


# -- optional: the complete traces in ../shared/traces (statistics of its README.md) -------------


@needs_shared
@pytest.mark.parametrize(
    ("full", "sliced", "rows"),
    [
        (AZURE, AZURE_SLICE, 1_000),
        (MOONCAKE_CONV, MOONCAKE_CONV_SLICE, 500),
        (MOONCAKE_SYN, MOONCAKE_SYN_SLICE, 500),
    ],
)
def test_committed_slices_are_the_head_of_the_full_traces(full: Path, sliced: Path, rows: int) -> None:
    with full.open("rb") as fh:
        head = b"".join(fh.readline() for _ in range(rows + (full.suffix == ".csv")))
    assert sliced.read_bytes() == head


@needs_shared
def test_committed_servegen_clients_are_copies_of_the_full_folder() -> None:
    for client in SERVEGEN_SLICE_CLIENTS:
        for kind in ("trace.csv", "dataset.json"):
            name = f"chunk-{client}-{kind}"
            assert (SERVEGEN_SLICE / name).read_bytes() == (SERVEGEN / name).read_bytes()


@needs_shared
def test_azure_real_trace_matches_readme() -> None:
    trace, elapsed = _timed_read(AZURE)
    assert detect_format(AZURE) == "azure"
    assert elapsed < 1.0
    assert trace.name == "azure:AzureLLMInferenceTrace_conv.csv"
    s = trace.summary()
    assert s["count"] == 19_366
    assert s["span_s"] == pytest.approx(3_501.7, abs=0.05)
    assert s["mean_rate"] == pytest.approx(5.53, abs=0.005)
    assert s["prompt_mean"] == pytest.approx(1_154.7, abs=0.05)
    assert (s["prompt_p50"], s["prompt_p99"], s["prompt_max"]) == (1_020, 4_142, 14_050)
    assert s["output_mean"] == pytest.approx(211.1, abs=0.05)
    assert (s["output_p50"], s["output_p99"], s["output_max"]) == (129, 601, 1_000)
    assert trace.prompt_tokens.min() == 2 and trace.output_tokens.min() == 7
    # First two rows: 18:15:46.6805900 and 18:15:50.9951690 (the 7th digit is kept).
    assert trace.arrivals[0] == 0.0
    assert trace.arrivals[1] == pytest.approx(4.3145790, abs=1e-7)
    gaps = np.diff(trace.arrivals)
    assert np.percentile(gaps, 50) == pytest.approx(0.118, abs=0.001)
    assert gaps.max() == pytest.approx(4.3, abs=0.05)
    assert index_of_dispersion(trace.arrivals) == pytest.approx(1.39, abs=0.01)
    assert trace.hash_ids is None


@needs_shared
def test_mooncake_conversation_real_trace_matches_readme() -> None:
    trace, elapsed = _timed_read(MOONCAKE_CONV)
    assert detect_format(MOONCAKE_CONV) == "mooncake"
    assert elapsed < 1.0
    s = trace.summary()
    assert s["count"] == 12_031
    assert s["span_s"] == pytest.approx(3_537, abs=0.5)
    assert s["prompt_mean"] == pytest.approx(12_035, abs=0.5)
    assert s["prompt_p50"] == 6_909 and s["prompt_max"] == 126_195
    assert s["prompt_p99"] == pytest.approx(85_400, abs=1)
    assert s["output_mean"] == pytest.approx(343, abs=0.5)
    assert s["output_p50"] == 350 and s["output_max"] == 2_000
    assert trace.prompt_tokens.min() == 891 and trace.output_tokens.min() == 1
    # coarse timestamps: 1,180 distinct values, batches about 3 s apart
    assert len(np.unique(trace.arrivals)) == 1_180
    assert index_of_dispersion(trace.arrivals) == pytest.approx(7.9, abs=0.05)
    # hash ids kept: ceil(input/512) blocks per row, 182,790 distinct ids
    assert trace.hash_ids is not None
    blocks = np.array([len(h) for h in trace.hash_ids])
    assert np.array_equal(blocks, -(-trace.prompt_tokens // 512))
    assert blocks.mean() == pytest.approx(23.98, abs=0.005)
    assert len({h for ids in trace.hash_ids for h in ids}) == 182_790


@needs_shared
def test_mooncake_synthetic_real_trace_matches_readme() -> None:
    trace = read_trace(MOONCAKE_SYN, "mooncake")
    s = trace.summary()
    assert s["count"] == 3_993
    assert s["span_s"] == pytest.approx(1_022, abs=0.5)
    assert s["prompt_mean"] == pytest.approx(15_325, abs=0.5)
    assert s["prompt_max"] == 191_378 and s["output_max"] == 893
    assert s["output_mean"] == pytest.approx(149, abs=0.5)


@needs_shared
def test_servegen_real_ten_minutes_fast_deterministic_and_at_the_csv_rate() -> None:
    assert detect_format(SERVEGEN) == "servegen"
    trace, elapsed = _timed_read(SERVEGEN, seed=3)
    assert elapsed < 5.0
    again = read_trace(SERVEGEN, seed=3)
    other = read_trace(SERVEGEN, seed=4)
    assert np.array_equal(trace.arrivals, again.arrivals)
    assert np.array_equal(trace.output_tokens, again.output_tokens)
    assert len(trace) != len(other) or not np.array_equal(trace.arrivals, other.arrivals)
    assert trace.arrivals[0] == 0.0 and trace.span_s < 600.0
    assert trace.prompt_tokens.min() >= 1 and trace.output_tokens.max() <= 32_768

    rates = _servegen_rates(SERVEGEN)
    assert len(rates) == 73
    start = 43_200.0  # three busy midday windows: aggregate counts vs the CSV rates
    busy = read_trace(SERVEGEN, seed=1, servegen_start_s=start, servegen_duration_s=1_800)
    expected = sum(float(r[(r[:, 0] >= start) & (r[:, 0] < start + 1_800), 1].sum()) * 600 for r in rates.values())
    assert expected > 10_000
    assert len(busy) == pytest.approx(expected, rel=0.08)


@needs_shared
def test_servegen_real_lengths_come_from_the_window_pmf() -> None:
    rates = _servegen_rates(SERVEGEN)
    start = 30_000.0  # inside the "21600" six-hour window
    client = max(rates, key=lambda c: float(rates[c][rates[c][:, 0] == start, 1].sum()))
    trace = read_trace(SERVEGEN, servegen_clients=[str(client)], servegen_start_s=start, servegen_duration_s=600)
    assert len(trace) > 50
    inputs = _pmf(SERVEGEN, client, "21600", "input_tokens")
    outputs = _pmf(SERVEGEN, client, "21600", "output_tokens")
    assert set(trace.prompt_tokens.tolist()) <= set(inputs)
    assert set(trace.output_tokens.tolist()) <= set(outputs)
    # the sample mean tracks the PMF mean
    assert trace.output_tokens.mean() == pytest.approx(_pmf_mean(outputs), rel=0.35)


# -- ServeGen on the small fixture folder -----------------------------------------------------


def test_servegen_fixture_same_seed_same_trace_other_seed_differs() -> None:
    a = read_trace(SERVEGEN_SAMPLE, seed=11, servegen_duration_s=3_000)
    b = read_trace(SERVEGEN_SAMPLE, seed=11, servegen_duration_s=3_000)
    c = read_trace(SERVEGEN_SAMPLE, seed=12, servegen_duration_s=3_000)
    assert a.name == "servegen:servegen_sample"
    for col in ("arrivals", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert len(a) != len(c) or not np.array_equal(a.arrivals, c.arrivals)
    assert a.arrivals[0] == 0.0 and np.all(np.diff(a.arrivals) >= 0)


def test_servegen_fixture_lengths_follow_the_six_hour_window_of_each_arrival() -> None:
    # client 7: dataset windows "0" and "1800" have disjoint supports; traffic at 0-600 and 1800-3000
    trace = read_trace(SERVEGEN_SAMPLE, servegen_clients=["chunk-7"], servegen_duration_s=3_000)
    origin = _origin(trace)
    t = trace.arrivals + origin
    early, late = t < 1_800, t >= 1_800
    assert early.sum() > 100 and late.sum() > 3_000
    assert set(trace.prompt_tokens[early].tolist()) == {55, 57}  # 56 has probability 0
    assert set(trace.output_tokens[early].tolist()) <= {1, 2}
    assert set(trace.prompt_tokens[late].tolist()) == {333}
    assert set(trace.output_tokens[late].tolist()) == {4_444, 5_555}
    share = float(np.mean(trace.output_tokens[late] == 5_555))
    assert share == pytest.approx(0.7, abs=0.03)


def test_servegen_fixture_rates_match_the_csv_windows() -> None:
    trace = read_trace(SERVEGEN_SAMPLE, servegen_clients=["0"], servegen_duration_s=2_400, seed=5)
    origin = _origin(trace)
    counts = np.bincount(((trace.arrivals + origin) // 600).astype(int), minlength=4)
    # rows: 0 (none), 2.0/s Poisson-like, 4.0/s gamma cv 2, 1.0/s Weibull cv 0.9
    assert counts[0] == 0
    assert counts[1] == pytest.approx(1_200, rel=0.12)
    assert counts[2] == pytest.approx(2_400, rel=0.2)
    assert counts[3] == pytest.approx(600, rel=0.15)
    assert origin >= 600.0


def test_servegen_window_samples_do_not_depend_on_the_requested_range() -> None:
    whole = read_trace(SERVEGEN_SAMPLE, servegen_duration_s=3_000, seed=2)
    part = read_trace(SERVEGEN_SAMPLE, servegen_start_s=1_800, servegen_duration_s=600, seed=2)
    origin_w = _origin(whole)
    origin_p = _origin(part)
    t = whole.arrivals + origin_w
    sel = (t >= 1_800) & (t < 2_400)
    assert np.allclose(t[sel], part.arrivals + origin_p)
    assert np.array_equal(whole.output_tokens[sel], part.output_tokens)


def test_servegen_clients_limit_and_errors(tmp_path: Path) -> None:
    one = read_trace(SERVEGEN_SAMPLE / "chunk-7-trace.csv", servegen_duration_s=600)
    assert set(one.prompt_tokens.tolist()) <= {55, 57}
    assert len(read_trace(SERVEGEN_SAMPLE, servegen_duration_s=3_000, limit=10)) == 10
    with pytest.raises(TraceError, match="unknown ServeGen client '3'"):
        read_trace(SERVEGEN_SAMPLE, servegen_clients=["3"])
    with pytest.raises(TraceError, match="past the end"):
        read_trace(SERVEGEN_SAMPLE, servegen_start_s=90_000)
    with pytest.raises(TraceError, match="duration"):
        read_trace(SERVEGEN_SAMPLE, servegen_duration_s=0)


def test_servegen_bad_rows_name_file_line_and_field(tmp_path: Path) -> None:
    folder = tmp_path / "sg"
    folder.mkdir()
    good_ds = (SERVEGEN_SAMPLE / "chunk-0-dataset.json").read_text()
    (folder / "chunk-0-dataset.json").write_text(good_ds)
    (folder / "chunk-0-trace.csv").write_text("0,1.0,1,Gamma,1,1\n600,fast,1,Gamma,1,1\n")
    with pytest.raises(TraceError, match=r"chunk-0-trace\.csv:2: field 'rate': .*'fast'"):
        read_trace(folder, "servegen")
    (folder / "chunk-0-trace.csv").write_text("0,1.0,1,Gamma,1,1\n600,1.0,1,Pareto,1,1\n")
    with pytest.raises(TraceError, match=r"chunk-0-trace\.csv:2: field 'pattern': .*'Pareto'"):
        read_trace(folder, "servegen")
    (folder / "chunk-0-trace.csv").write_text("0,1.0,1,Gamma,1,1\n")
    bad = json.loads(good_ds)
    bad["0"]["output_tokens"] = "{100: 0.5, 200: oops}"
    (folder / "chunk-0-dataset.json").write_text(json.dumps(bad, indent=2))
    with pytest.raises(TraceError, match=r"chunk-0-dataset\.json:\d+: window '0' field 'output_tokens'"):
        read_trace(folder, "servegen")


# -- BurstGPT ----------------------------------------------------------------------------------


def test_burstgpt_fixture_skips_failed_rows() -> None:
    path = DATA / "burstgpt_sample.csv"
    assert detect_format(path) == "burstgpt"
    trace = read_trace(path)
    assert len(trace) == 37 and trace.skipped == 3
    assert trace.summary()["skipped"] == 3
    assert "skipped 3 failed rows" in trace.source
    assert trace.arrivals[0] == 0.0  # first Timestamp is 5 s
    assert trace.arrivals[-1] == pytest.approx(1_394 - 5)
    assert trace.output_tokens.min() >= 1
    with path.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["Response tokens"] != "0"]
    assert trace.prompt_tokens.tolist() == [int(r["Request tokens"]) for r in rows]
    assert trace.output_tokens.tolist() == [int(r["Response tokens"]) for r in rows]


def test_burstgpt_v3_columns_by_name(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "BurstGPT_3.csv",
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type,Elapsed time\n"
        "10.5,s1,ChatGPT,100,20,120,Conversation log,1.2\n"
        "12.0,s1,ChatGPT,150,0,150,Conversation log,0.4\n"
        "12.0,s2,GPT-4,30,300,330,API log,9.1\n",
    )
    trace = read_trace(path, "burstgpt")
    assert trace.arrivals.tolist() == [0.0, 1.5]
    assert trace.prompt_tokens.tolist() == [100, 30]
    assert trace.skipped == 1


def test_burstgpt_bad_row(tmp_path: Path) -> None:
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    ok = "5,ChatGPT,10,20,30,Conversation log\n"
    path = _write(tmp_path, "burst.csv", head + ok + ok + "soon,ChatGPT,1,2,3,API log\n")
    with pytest.raises(TraceError, match=r"burst\.csv:4: field 'Timestamp': .*'soon'"):
        read_trace(path)
    path = _write(tmp_path, "burst.csv", head + ok + "6,GPT-4,-5,2,3,API log\n")
    with pytest.raises(TraceError, match=r"burst\.csv:3: field 'Request tokens': .*'-5'"):
        read_trace(path)


# -- Azure and Mooncake fixtures and bad rows --------------------------------------------------


def test_azure_fixture_crosses_midnight_with_100ns_precision() -> None:
    trace = read_trace(DATA / "azure_sample.csv")
    assert np.allclose(trace.arrivals, [0.0, 1.0999999, 1.1000001, 2.6, 5.35], atol=1e-9, rtol=0)
    assert trace.output_tokens.tolist() == [44, 109, 62, 1000, 7]


def test_azure_bad_row(tmp_path: Path) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{10 + i:02d}.6805900,374,44" for i in range(15)]
    rows.append("2023-11-16 18:16:00.0000000,abc,44")
    path = _write(tmp_path, "AzureLLMInferenceTrace_conv.csv", "\n".join(rows) + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value).startswith(
        "AzureLLMInferenceTrace_conv.csv:17: field 'ContextTokens': expected a positive integer, got 'abc'"
    )
    rows[-1] = "yesterday,1,44"
    path = _write(tmp_path, "az.csv", "\n".join(rows) + "\n")
    with pytest.raises(TraceError, match=r"az\.csv:17: field 'TIMESTAMP': .*'yesterday'"):
        read_trace(path, "azure")
    path = _write(tmp_path, "az2.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:10,5\n")
    with pytest.raises(TraceError, match=r"az2\.csv:2: field 'GeneratedTokens': missing"):
        read_trace(path)


def test_mooncake_fixture_and_resorting(tmp_path: Path) -> None:
    trace = read_trace(DATA / "mooncake_sample.jsonl")
    assert trace.arrivals.tolist() == [0.0, 0.0, 3.001, 3.001, 6.002]
    assert trace.hash_ids is not None and trace.hash_ids[2] == [0, 1, 4]
    lines = (DATA / "mooncake_sample.jsonl").read_text().splitlines()
    path = _write(tmp_path, "shuffled.jsonl", "\n".join([lines[4], lines[0], lines[2]]) + "\n")
    shuffled = read_trace(path)
    assert shuffled.arrivals.tolist() == [0.0, 3.001, 6.002]
    assert shuffled.prompt_tokens.tolist() == [1200, 1536, 2049]
    assert shuffled.hash_ids == [[0, 1, 2], [0, 1, 4], [0, 1, 2, 6, 7]]
    assert "re-sorted" in shuffled.source


def test_mooncake_bad_rows(tmp_path: Path) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'
    path = _write(tmp_path, "m.jsonl", good + '{"timestamp": 5, "input_length": 10, "output_length": "x"}\n')
    with pytest.raises(TraceError, match=r"m\.jsonl:2: field 'output_length': .*'x'"):
        read_trace(path)
    path = _write(tmp_path, "m.jsonl", good + good + '{"timestamp": 5, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"m\.jsonl:3: field 'input_length': missing"):
        read_trace(path)
    path = _write(tmp_path, "m.jsonl", good + '{"timestamp": -1, "input_length": 1, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"m\.jsonl:2: field 'timestamp'"):
        read_trace(path, "mooncake")
    path = _write(tmp_path, "m.jsonl", good + '{"timestamp": 1, "input_length": 1,\n')
    with pytest.raises(TraceError, match=r"m\.jsonl:2: invalid JSON"):
        read_trace(path, "mooncake")


# -- detection and file-level errors -----------------------------------------------------------


def test_detect_format_on_each_format() -> None:
    assert detect_format(DATA / "mooncake_sample.jsonl") == "mooncake"
    assert detect_format(DATA / "azure_sample.csv") == "azure"
    assert detect_format(DATA / "burstgpt_sample.csv") == "burstgpt"
    assert detect_format(SERVEGEN_SAMPLE) == "servegen"
    assert detect_format(SERVEGEN_SAMPLE / "chunk-0-trace.csv") == "servegen"
    assert detect_format(AZURE_SLICE) == "azure"
    assert detect_format(MOONCAKE_CONV_SLICE) == "mooncake"
    assert detect_format(MOONCAKE_SYN_SLICE) == "mooncake"
    assert detect_format(SERVEGEN_SLICE) == "servegen"


def test_unknown_missing_and_empty_inputs(tmp_path: Path) -> None:
    odd = _write(tmp_path, "odd.csv", "when,what\n1,2\n")
    with pytest.raises(TraceError, match="unknown trace format") as info:
        detect_format(odd)
    for name in FORMATS:
        assert name in str(info.value)
    json_other = _write(tmp_path, "other.jsonl", '{"prompt": "hi"}\n')
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(json_other)
    with pytest.raises(TraceError, match="unknown trace format"):
        detect_format(tmp_path)  # a folder without ServeGen chunks
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "nope.csv", "azure")
    empty = _write(tmp_path, "empty.jsonl", "\n  \n")
    with pytest.raises(TraceError, match="empty"):
        read_trace(empty)
    with pytest.raises(TraceError, match="empty"):
        read_trace(empty, "mooncake")
    with pytest.raises(TraceError, match="unknown trace format 'sharegpt'") as info:
        read_trace(DATA / "azure_sample.csv", "sharegpt")
    assert all(name in str(info.value) for name in FORMATS)
    header_only = _write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no data rows"):
        read_trace(header_only)


# -- Trace operations on a hand-built trace ----------------------------------------------------


def _hand_trace() -> Trace:
    return Trace(
        name="hand",
        arrivals=np.array([0.0, 1.0, 2.0, 2.0, 5.0, 9.0]),
        prompt_tokens=np.array([10, 20, 30, 40, 50, 60]),
        output_tokens=np.array([1, 2, 3, 4, 5, 100]),
        slo_class=["a", "b", "a", "b", "a", "b"],
        priority=np.array([0, 1, 2, 3, 4, 5]),
        hash_ids=[[0], [1], [2], [3], [4], [5]],
        source="hand-made",
    )


def test_window_selects_rebases_and_limits() -> None:
    trace = _hand_trace()
    w = trace.window(1.0, 4.0)  # 1 <= t < 5
    assert w.arrivals.tolist() == [0.0, 1.0, 1.0]
    assert w.prompt_tokens.tolist() == [20, 30, 40]
    assert w.slo_class == ["b", "a", "b"]
    assert w.priority is not None and w.priority.tolist() == [1, 2, 3]
    assert w.hash_ids == [[1], [2], [3]]
    assert trace.window(1.0, 4.0, limit=2).prompt_tokens.tolist() == [20, 30]
    assert trace.window(4.5).arrivals.tolist() == [0.0, 4.0]  # no duration: to the end
    assert len(trace.window(9.5, 10.0)) == 0
    assert len(trace) == 6 and trace.arrivals[1] == 1.0  # the original is untouched


def test_scale_time_and_with_rate() -> None:
    trace = _hand_trace()
    assert trace.mean_rate() == pytest.approx(5 / 9)
    fast = trace.scale_time(0.5)
    assert fast.arrivals.tolist() == [0.0, 0.5, 1.0, 1.0, 2.5, 4.5]
    assert fast.mean_rate() == pytest.approx(10 / 9)
    assert np.array_equal(fast.output_tokens, trace.output_tokens)
    at2 = trace.with_rate(2.0)
    assert at2.mean_rate() == pytest.approx(2.0)
    assert at2.span_s == pytest.approx(2.5)
    assert np.allclose(at2.arrivals / at2.arrivals[-1], trace.arrivals / trace.arrivals[-1])
    with pytest.raises(TraceError):
        trace.scale_time(0.0)
    with pytest.raises(TraceError):
        trace.with_rate(-1.0)
    burst = Trace("burst", np.zeros(3), np.ones(3, dtype=np.int64), np.ones(3, dtype=np.int64))
    with pytest.raises(TraceError, match="same instant"):
        burst.with_rate(1.0)


def test_requests_and_summary() -> None:
    trace = _hand_trace()
    reqs = list(trace.requests("q"))
    assert len(reqs) == 6 and all(isinstance(r, Request) for r in reqs)
    assert reqs[5] == Request(id="q5", arrival=9.0, prompt_tokens=60, max_tokens=100, slo_class="b", priority=5)
    assert isinstance(reqs[0].prompt_tokens, int) and isinstance(reqs[0].arrival, float)
    plain = Trace("p", np.array([0.0, 1.0]), np.array([3, 4]), np.array([5, 6]))
    assert [(r.id, r.slo_class, r.priority) for r in plain.requests()] == [
        ("r0", "default", 0),
        ("r1", "default", 0),
    ]
    s = trace.summary()
    assert s["count"] == 6 and s["span_s"] == 9.0
    assert s["mean_rate"] == pytest.approx(5 / 9)
    assert s["prompt_mean"] == 35.0 and s["prompt_p50"] == 35.0 and s["prompt_max"] == 60
    assert s["output_max"] == 100 and s["output_p99"] == pytest.approx(5 + 0.95 * 95)
    empty = trace.window(100.0)
    assert empty.summary()["count"] == 0 and empty.summary()["output_max"] == 0


def test_trace_validates_its_columns() -> None:
    with pytest.raises(TraceError, match="prompt_tokens"):
        Trace("x", np.array([0.0, 1.0]), np.array([1]), np.array([1, 1]))
    with pytest.raises(TraceError, match="not sorted"):
        Trace("x", np.array([1.0, 0.0]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(TraceError, match=">= 1"):
        Trace("x", np.array([0.0, 1.0]), np.array([1, 0]), np.array([1, 1]))


# -- synthetic workloads and arrivals ----------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "prompt_mean", "prompt_range", "out_mean", "out_std", "capped"),
    [
        ("reasoning-chat", 183.0, (4, 1024), 5657.0, 3317.0, 0.573),
        ("reasoning-code", 345.0, (1, 1700), 6500.0, 2600.0, 0.619),
    ],
)
def test_reasoning_workload_moments(
    workload: str,
    prompt_mean: float,
    prompt_range: tuple[int, int],
    out_mean: float,
    out_std: float,
    capped: float,
) -> None:
    prompts, outputs = synthetic_lengths(workload, 200_000, np.random.default_rng(0))
    assert prompts.dtype == np.int64 and outputs.dtype == np.int64
    assert prompts.mean() == pytest.approx(prompt_mean, rel=0.03)
    assert outputs.mean() == pytest.approx(out_mean, rel=0.03)
    assert outputs.std() == pytest.approx(out_std, rel=0.03)
    assert prompt_range[0] <= prompts.min() and prompts.max() <= prompt_range[1]
    assert outputs.min() >= 1 and outputs.max() == OUTPUT_CAP
    assert float(np.mean(outputs == OUTPUT_CAP)) == pytest.approx(capped, abs=0.01)


def test_random_workload_is_uniform_and_synthetic_trace_is_seeded() -> None:
    prompts, outputs = synthetic_lengths("random", 100_000, np.random.default_rng(1))
    assert (prompts.min(), prompts.max()) == (1, 512)
    assert (outputs.min(), outputs.max()) == (1, 8192)
    assert prompts.mean() == pytest.approx(256.5, rel=0.01)
    assert outputs.mean() == pytest.approx(4096.5, rel=0.01)
    assert set(WORKLOADS) == {"random", "reasoning-chat", "reasoning-code"}

    a = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=4)
    b = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=4)
    slower = synthetic_trace("reasoning-chat", requests=5_000, rate=2.0, seed=4, burstiness=0.5)
    c = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=5)
    assert a.name == "synthetic:reasoning-chat" and "rate=10" in a.source and "seed=4" in a.source
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.output_tokens, b.output_tokens)
    assert np.array_equal(a.output_tokens, slower.output_tokens)  # lengths independent of arrivals
    assert not np.array_equal(a.output_tokens, c.output_tokens)
    assert a.arrivals[0] == 0.0 and a.mean_rate() == pytest.approx(10.0, rel=0.05)
    assert slower.mean_rate() == pytest.approx(2.0, rel=0.05)
    with pytest.raises(TraceError, match="unknown synthetic workload"):
        synthetic_trace("sharegpt", requests=1, rate=1.0)


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
