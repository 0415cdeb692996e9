"""benchmarks/routing_sweep.py on two small cells: a row per cell and policy, resumption, and the report."""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def _sweep_module():
    return importlib.import_module("benchmarks.routing_sweep")


def test_sweep_cells_produce_rows_and_resume(tmp_path: Path) -> None:
    sw = _sweep_module()
    from core.perf import get_profile

    cells = [
        sw.Cell("random", "ps", 4, "1:4", 0.9, "poisson"),
        sw.Cell("reasoning-chat", "iteration", 4, "1:1", 0.8, "bursty"),
    ]
    policies = [p for p in sw.POLICIES if p.label in ("least_load", "sibyl(lifetime)", "clairvoyant")]
    out = tmp_path / "sweep.jsonl"
    logs: list[str] = []
    prof = get_profile("h20-qwen3-32b")
    rows = sw.sweep(cells, policies, out, requests=150, seed=3, profile=prof, log=logs.append)
    assert len(rows) == 6 and len(out.read_text().splitlines()) == 6
    for r in rows:
        assert {
            "cell",
            "policy",
            "tpot_p99",
            "tpot_p999",
            "tpot_mean",
            "slo_attainment",
            "mode",
            "decode",
            "prefill",
            "load",
            "arrival",
            "workload",
        } <= set(r)
        assert r["completed"] == 150 and r["tpot_p99"] > 0
    assert rows[-1]["params"] == {"model": "iteration"}  # the oracle is told the decode model
    assert cells[1].prefill == 4 and cells[0].prefill == 1
    logs.clear()
    again = sw.sweep(cells, policies, out, requests=150, seed=3, profile=prof, log=logs.append)
    assert "0 to go" in logs[0] and len(again) == 6
    assert len(out.read_text().splitlines()) == 6  # nothing re-run
    md, js = sw.write_report(again, out, [p.label for p in policies])
    assert "headroom" in md.read_text()
    summary = json.loads(js.read_text())
    assert {s["cell"] for s in summary} == {c.key for c in cells}
    assert all("headroom" in s for s in summary)
