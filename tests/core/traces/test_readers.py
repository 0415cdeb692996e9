"""The real-trace readers (core/traces/readers.py): Azure, Mooncake and BurstGPT, format detection and file errors.

The real-trace tests run on small unmodified slices of the real traces kept in
tests/data/traces/ (see its README.md for sources, licences and how each slice was cut); the
expected numbers were computed by hand from those slices. The tests marked ``needs_shared``
re-check the readers on the complete traces in ../shared/traces when that folder exists.
The property-based tests (hypothesis) feed the readers random bytes and rows: bad input is a
TraceError naming the file (and the line and field of a bad row), never another exception type.
"""

from __future__ import annotations

import csv
import json
import string
import tempfile
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from core.errors import TraceError
from core.traces import (
    FORMATS,
    Trace,
    detect_format,
    index_of_dispersion,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_trace,
)
from tests.core.traces.trace_files import (
    AZURE,
    AZURE_SLICE,
    DATA,
    MOONCAKE_CONV,
    MOONCAKE_CONV_SLICE,
    MOONCAKE_SYN,
    MOONCAKE_SYN_SLICE,
    SERVEGEN_SAMPLE,
    SERVEGEN_SLICE,
    needs_shared,
    timed_read,
    write_bytes,
)
from tests.fuzzing import FAST, json_values


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
def test_azure_real_trace_matches_readme() -> None:
    trace, elapsed = timed_read(AZURE)
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
    trace, elapsed = timed_read(MOONCAKE_CONV)
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


# -- property-based: random bytes and rows ------------------------------------------------------


READERS = {"mooncake": read_mooncake, "azure": read_azure, "burstgpt": read_burstgpt, "auto": read_trace}


def read_or_error(reader: Any, path: Path) -> Trace | TraceError:
    try:
        trace = reader(path)
    except TraceError as e:
        assert path.name in str(e), str(e)  # the error names the file
        return e
    assert isinstance(trace, Trace)
    return trace


@FAST
@given(data=st.binary(max_size=300), reader=st.sampled_from(sorted(READERS)))
@example(data=b"\xef\xbb\xbf", reader="auto")
@example(data=b"\x00\x00", reader="azure")
@example(data=b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n\xff', reader="auto")
@example(data=b'{"timestamp": ' + b"1" * 5000 + b', "input_length": 1, "output_length": 1}', reader="auto")
@example(
    data=b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": ' + b"1" * 5000 + b"}",
    reader="mooncake",
)
def test_trace_readers_on_random_bytes(data: bytes, reader: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        read_or_error(READERS[reader], write_bytes(tmp, "trace.txt", data))


cells = st.one_of(
    st.integers(min_value=-5, max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=string.printable.replace("\r", "").replace("\n", ""), max_size=12),
    st.sampled_from(
        [
            "",
            " ",
            "1e400",
            "9" * 25,
            "2023-11-16 18:15:46.6805900",
            "2023-02-30 00:00:00",
            "2023-11-16 24:00:00",
            '"1,2"',
        ]
    ),
)


def row_error_names_line_and_field(err: TraceError, fields: tuple[str, ...]) -> None:
    text = str(err)
    if "field '" in text:
        field = text.split("field '", 1)[1].split("'", 1)[0]
        assert field in fields, text
        assert text.split(":", 2)[1].isdigit(), text  # name:line: field ...


@FAST
@given(
    rows=st.lists(st.tuples(cells, cells, cells), min_size=1, max_size=6), fmt=st.sampled_from(["azure", "burstgpt"])
)
@example(rows=[("2023-11-16 18:15:46", "99999999999999999999", "1")], fmt="azure")
@example(rows=[("1", "99999999999999999999", "3")], fmt="burstgpt")
def test_csv_readers_on_random_rows(rows: list[tuple[str, str, str]], fmt: str) -> None:
    fields = (
        ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if fmt == "azure"
        else ("Timestamp", "Request tokens", "Response tokens")
    )
    text = ",".join(fields) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        got = read_or_error(READERS[fmt], write_bytes(tmp, f"{fmt}.csv", text.encode()))
    if isinstance(got, TraceError):
        row_error_names_line_and_field(got, fields)
    else:
        assert len(got) >= 1 and (got.prompt_tokens >= 1).all()


mooncake_values = st.one_of(
    json_values,
    st.integers(min_value=-5, max_value=2**80),
    st.floats(min_value=0, max_value=1e308),
    st.sampled_from([0, 1, 1.5, 2**63, 10**400]),
)


@FAST
@given(
    rows=st.lists(
        st.dictionaries(
            st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]), mooncake_values, min_size=2
        ),
        min_size=1,
        max_size=5,
    )
)
@example(rows=[{"timestamp": 0, "input_length": 2**63, "output_length": 1}])
@example(rows=[{"timestamp": 0, "input_length": 1e300, "output_length": 1}])
@example(rows=[{"timestamp": 10**400, "input_length": 1, "output_length": 1}])
def test_mooncake_on_random_rows(rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        got = read_or_error(read_mooncake, write_bytes(tmp, "m.jsonl", text.encode()))
    if isinstance(got, TraceError):
        row_error_names_line_and_field(got, ("timestamp", "input_length", "output_length", "hash_ids"))
    else:
        assert len(got) == len(rows)


def test_a_csv_field_over_the_csv_module_limit_is_a_trace_error(tmp_path: Path) -> None:
    path = write_bytes(
        str(tmp_path), "big.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b'"' + b"1" * 200_000 + b'",1,1\n'
    )
    with pytest.raises(TraceError, match=r"big\.csv:2"):
        read_azure(path)
