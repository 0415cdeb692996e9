"""The fidelity table's arithmetic and bounds, on hand-made metrics (the real-vLLM stage feeds it real runs)."""

from __future__ import annotations

import pytest

from console.fidelity import GATE, build_rows, failures, table


def metrics(ttft50: float, ttft99: float, tpot50: float, tpot99: float) -> dict[str, float]:
    return {"ttft_p50": ttft50, "ttft_p99": ttft99, "tpot_p50": tpot50, "tpot_p99": tpot99}


REAL = {"light": [metrics(0.200, 0.300, 0.007, 0.011), metrics(0.220, 0.340, 0.009, 0.011)],
        "queueing": [metrics(1.000, 1.500, 0.020, 0.028), metrics(0.900, 1.500, 0.018, 0.028)]}


def test_deviation_spread_target_and_gate_by_hand() -> None:
    predicted = {"emulator": {"light": metrics(0.180, 0.200, 0.0066, 0.007), "queueing": metrics(0.650, 1.000, 0.019, 0.025)},
                 "simulator": {"light": metrics(0.170, 0.210, 0.006, 0.007), "queueing": metrics(0.440, 0.750, 0.020, 0.026)}}
    rows = {(r.load, r.metric, r.stat): r for r in build_rows(REAL, predicted)}
    assert len(rows) == 8
    light_ttft = rows["light", "ttft", "p50"]
    assert light_ttft.real_mean == pytest.approx(0.210)
    assert light_ttft.spread == pytest.approx(0.020 / 0.210)
    assert light_ttft.deviation("emulator") == pytest.approx(0.180 / 0.210 - 1)  # -14.3%
    assert light_ttft.target == 0.15 and light_ttft.meets_target("emulator") is True
    assert light_ttft.meets_target("simulator") is False  # -19%
    # within the real runs' own range counts as met even past the relative bound
    tpot = rows["light", "tpot", "p50"]
    assert tpot.deviation("emulator") == pytest.approx(0.0066 / 0.008 - 1) and tpot.meets_target("emulator") is False
    assert rows["queueing", "ttft", "p99"].target is None and rows["queueing", "ttft", "p99"].meets_target("emulator") is None
    assert rows["queueing", "tpot", "p50"].meets_target("simulator") is True  # 20.0 lies within 18-20
    # the gate is ±50% plus the row's real spread: queueing TTFT p50 (spread 100/950 = 10.5%) lets
    # the emulator's -32% and the simulator's -54% through but not -61%; p99 (no spread) stops -50.1%
    assert GATE == 0.5 and rows["queueing", "ttft", "p50"].gate == pytest.approx(0.5 + 100 / 950)
    assert failures(list(rows.values())) == []
    worse = {"emulator": predicted["emulator"], "simulator": {**predicted["simulator"], "queueing": metrics(0.370, 0.749, 0.020, 0.026)}}
    assert failures(build_rows(REAL, worse)) == [
        "queueing TTFT p50: simulator 370.0 ms vs real 950.0 ms (-61%, gate ±61%: 50% + the real runs' spread)",
        "queueing TTFT p99: simulator 749.0 ms vs real 1500.0 ms (-50%, gate ±50%: 50% + the real runs' spread)",
    ]
    text = table(list(rows.values()))
    assert "| light | TTFT p50 | 200.0 / 220.0 | 10% | 180.0 (-14%) | 170.0 (-19%) | ±15% | yes | no | ±60% |" in text
    assert "| queueing | TTFT p99 | 1500.0 / 1500.0 | 0% | 1000.0 (-33%) | 750.0 (-50%) | - | - | - | ±50% |" in text
