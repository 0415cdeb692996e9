"""benchmarks/prefix_sweep.py --quick on a small slice: the table's structure, resumption, and the hit-rate bounds
(nothing beats the ideal; the oracle beats the cache-blind routers and precise prefix_aware)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DATA = Path(__file__).parents[1] / "data" / "traces"


def _sweep() -> Any:
    return importlib.import_module("benchmarks.prefix_sweep")


def traces(tmp_path: Path) -> Path:
    """A traces folder laid out as ../shared/traces, holding the test data's slices."""
    folder = tmp_path / "traces"
    for src, dst in (
        ("mooncake_conversation_first500.jsonl", "mooncake_fast25/conversation_trace.jsonl"),
        ("mooncake_synthetic_first500.jsonl", "mooncake_fast25/synthetic_trace.jsonl"),
        ("azure_conv_first1000.csv", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"),
    ):
        (folder / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / src, folder / dst)
    return folder


@pytest.mark.slow  # ~20 s of simulations (make test-slow)
def test_quick_sweep_table_resumes_and_bounds_the_hit_rates(tmp_path: Path, capsys: Any) -> None:
    sw = _sweep()
    out = tmp_path / "q.jsonl"
    args = ["--quick", "--requests", "200", "--out", str(out), "--traces", str(traces(tmp_path))]
    sw.main(args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    labels = [p.label for p in sw.POLICIES]
    cells = [c.key for c in sw.GRIDS["quick"]]
    assert [(r["cell"], r["policy"]) for r in rows] == [(c, p) for c in cells for p in labels]
    assert all(r["failed"] == 0 and r["completed"] == 200 for r in rows)

    md = out.with_suffix(".md").read_text()
    header = "| cell | policy | TTFT p50 | TTFT p99 | TTFT mean | P99 TPOT | hit | /ideal | /oracle | KV moved |"
    assert header in md
    assert sum(line.startswith("| mooncake-conv/") for line in md.splitlines()) == len(labels) + 1  # + the floor row
    assert "Targets (issue 27)" in md and "approximate within 10 points of precise" in md
    report = json.loads(out.with_suffix(".json").read_text())
    assert {t["target"] for t in report["targets"][cells[0]]} >= {"precise hit rate ≥ 90% of the oracle's"}
    assert all({"cell", "policy", "ttft_p99", "hit_rate", "of_ideal", "d_ttft_p99"} <= r.keys() for r in report["rows"])

    by = {(r["cell"], r["policy"]): r for r in rows}
    conv, azure = cells
    ideal = by[(conv, "least_load")]["ideal_hit_rate"]
    hits = {p: by[(conv, p)]["prefix_hit_rate"] for p in labels}
    assert 0 < max(hits.values()) <= ideal  # the ideal bounds every policy
    # The oracle places each prefill where its true TTFT is least, knowing every cache and what the
    # queued requests will cache. It finds at least as much as the cache-blind routers. Since prefill
    # is projected as vLLM batches it (issue 37), it no longer bounds precise prefix_aware's hits: a
    # prompt that joins a step with room costs its uncached tokens' share of one step, so the true
    # TTFT often prefers an instance with room over the one holding the prefix (4.6% against 5.1% on
    # this cell, at the same TTFT p50/p99), where prefix_aware's load guard keeps it on the holder.
    for p in ("least_load", "round_robin", "sibyl"):
        assert hits["oracle"] >= hits[p] - 1e-12, p
    # the control has nothing to reuse: no hits, every prompt moves in full
    assert all(by[(azure, p)]["prefix_hit_rate"] == 0 for p in labels)
    assert np.isclose(by[(azure, "least_load")]["ideal_hit_rate"], 0.0)

    # a re-run finds every cell done and only rebuilds the report
    capsys.readouterr()
    sw.main(args)
    assert "0 to go" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == len(rows)
