"""The traces' LoRA adapters: the readers' `lora` column and its errors, and the seeded Zipf mix."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from core.errors import TraceError
from core.traces import read_trace
from core.traces.lora import adapter_names, zipf_mix, zipf_weights


def _mooncake(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_mooncake_lora_field_is_each_rows_adapter_kept_through_resorting(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 2000, "input_length": 10, "output_length": 5, "lora": "b"},
        {"timestamp": 1000, "input_length": 11, "output_length": 6, "lora": "a"},
        {"timestamp": 3000, "input_length": 12, "output_length": 7, "lora": None},
        {"timestamp": 4000, "input_length": 13, "output_length": 8},
        {"timestamp": 5000, "input_length": 14, "output_length": 9, "lora": "  "},
    ]
    t = read_trace(_mooncake(tmp_path / "t.jsonl", rows))
    assert t.prompt_tokens.tolist() == [11, 10, 12, 13, 14]
    assert t.lora == ["a", "b", None, None, None]
    reqs = list(t.requests())
    assert [r.lora for r in reqs] == ["a", "b", None, None, None]
    assert t.window(start=0.5).lora == ["b", None, None, None]


def test_a_trace_without_adapters_has_no_lora_column(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [{"timestamp": 0, "input_length": 10, "output_length": 5, "lora": ""}]
    assert read_trace(_mooncake(tmp_path / "t.jsonl", rows)).lora is None


@pytest.mark.parametrize(
    ("value", "why"),
    [(3, "expected an adapter name"), (["a"], "expected an adapter name"), ("a b", "no whitespace or comma"),
     ("a,b", "no whitespace or comma")],
)
def test_mooncake_bad_lora_names_file_line_and_field(tmp_path: Path, value: object, why: str) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 10, "output_length": 5},
        {"timestamp": 1, "input_length": 10, "output_length": 5, "lora": value},
    ]
    with pytest.raises(TraceError) as e:
        read_trace(_mooncake(tmp_path / "bad.jsonl", rows))
    assert str(e.value).startswith("bad.jsonl:2: field 'lora': ")
    assert why in str(e.value)


def test_azure_and_burstgpt_lora_column(tmp_path: Path) -> None:
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens,lora\n"
        "2023-11-16 18:15:46.0000000,100,10,x\n"
        "2023-11-16 18:15:47.0000000,200,20,\n"
        "2023-11-16 18:15:48.0000000,300,30\n"
    )
    assert read_trace(azure).lora == ["x", None, None]
    burst = tmp_path / "burst.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,LoRA\n"
        "5,m,10,0,10,c,y\n"  # a failed row (0 response tokens) is dropped with its adapter
        "6,m,10,5,15,c,z\n"
        "7,m,10,5,15,c,\n"
    )
    assert read_trace(burst).lora == ["z", None]
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,lora\n2023-11-16 18:15:46,100,10,a b\n")
    with pytest.raises(TraceError, match=r"^bad\.csv:2: field 'lora': an adapter name has no whitespace"):
        read_trace(bad)


def test_zipf_mix_is_seeded_and_follows_the_skew() -> None:
    a = zipf_mix(20_000, 10, 1.0, seed=3)
    assert a == zipf_mix(20_000, 10, 1.0, seed=3)
    assert a != zipf_mix(20_000, 10, 1.0, seed=4)
    names = adapter_names(10)
    assert names[0] == "lora-00" and names[-1] == "lora-09"
    counts = Counter(a)
    assert set(counts) == set(names)
    # rank k has weight 1/k over H(10) = 2.929: lora-00 29.3%, lora-01 14.6%, lora-09 2.9%
    shares = np.array([counts[n] / len(a) for n in names])
    expected = np.array([1 / k for k in range(1, 11)]) / sum(1 / k for k in range(1, 11))
    assert np.allclose(zipf_weights(10, 1.0), expected)
    assert np.abs(shares - expected).max() < 0.01
    assert shares[0] / shares[1] == pytest.approx(2.0, rel=0.08)
    uniform = Counter(zipf_mix(20_000, 4, 0.0, seed=0))
    assert max(uniform.values()) - min(uniform.values()) < 400  # 5000 each, ±2.8σ


def test_zipf_mix_rejects_bad_parameters() -> None:
    with pytest.raises(TraceError, match="--lora-adapters"):
        zipf_mix(10, 0, 1.0)
    with pytest.raises(TraceError, match="--lora-skew"):
        zipf_mix(10, 5, -1.0)
