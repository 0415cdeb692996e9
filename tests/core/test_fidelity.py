"""The fidelity table's arithmetic and bounds, on hand-made metrics (the real-vLLM stage feeds it real runs)."""

from __future__ import annotations

import pytest

from core.fidelity import UNTARGETED, Row, build_rows, failures, table


def metrics(ttft50: float, ttft99: float, tpot50: float, tpot99: float) -> dict[str, float]:
    return {"ttft_p50": ttft50, "ttft_p99": ttft99, "tpot_p50": tpot50, "tpot_p99": tpot99}


REAL = {
    "light": [
        metrics(0.200, 0.300, 0.007, 0.011),
        metrics(0.220, 0.340, 0.009, 0.011),
        metrics(0.260, 0.320, 0.008, 0.011),
    ],
    "queueing": [metrics(1.000, 1.500, 0.020, 0.028), metrics(0.900, 1.500, 0.018, 0.028)],
}
PREDICTED = {
    "emulator": {"light": metrics(0.258, 0.250, 0.0066, 0.008), "queueing": metrics(0.650, 1.000, 0.019, 0.025)},
    "simulator": {"light": metrics(0.170, 0.210, 0.0085, 0.008), "queueing": metrics(0.700, 0.760, 0.020, 0.026)},
}


def test_deviations_are_from_the_real_runs_median_and_targets_also_count_their_range() -> None:
    rows = {(r.load, r.metric, r.stat): r for r in build_rows(REAL, PREDICTED)}
    assert len(rows) == 8
    light_ttft = rows["light", "ttft", "p50"]
    assert light_ttft.reference == pytest.approx(0.220)  # the median of 200, 220, 260
    assert light_ttft.spread == pytest.approx(0.060 / 0.220)
    assert light_ttft.deviation("simulator") == pytest.approx(0.170 / 0.220 - 1)  # -22.7%
    assert light_ttft.target == 0.15 and light_ttft.meets_target("simulator") is False
    # +17.3% is past ±15%, but 258 ms lies within the real runs' own 200-260 ms
    assert (
        light_ttft.deviation("emulator") == pytest.approx(0.258 / 0.220 - 1)
        and light_ttft.meets_target("emulator") is True
    )
    tpot = rows["light", "tpot", "p50"]
    assert (
        tpot.deviation("emulator") == pytest.approx(0.0066 / 0.008 - 1) and tpot.meets_target("emulator") is False
    )  # -17.5%
    assert tpot.meets_target("simulator") is True  # +6.3%
    assert (
        rows["queueing", "ttft", "p99"].target is None
        and rows["queueing", "ttft", "p99"].meets_target("emulator") is None
    )


def test_the_gate_is_the_target_plus_the_real_runs_spread_and_fails_past_it() -> None:
    rows = {(r.load, r.metric, r.stat): r for r in build_rows(REAL, PREDICTED)}
    assert rows["light", "ttft", "p50"].gate == pytest.approx(0.15 + 0.060 / 0.220)
    assert rows["light", "tpot", "p99"].gate == pytest.approx(0.30)  # no spread: the target alone
    assert rows["queueing", "ttft", "p50"].gate == pytest.approx(0.25 + 0.100 / 0.950)
    assert UNTARGETED == 0.5 and rows["queueing", "ttft", "p99"].gate == pytest.approx(0.5)
    # the simulator's queueing TTFT p50 (-26%) misses its target but passes the gate (35.5%)
    assert rows["queueing", "ttft", "p50"].meets_target("simulator") is False and rows[
        "queueing", "ttft", "p50"
    ].within_gate("simulator")
    assert failures(list(rows.values())) == []
    worse = {**PREDICTED, "simulator": {**PREDICTED["simulator"], "queueing": metrics(0.600, 0.749, 0.020, 0.026)}}
    assert failures(build_rows(REAL, worse)) == [
        "queueing TTFT p50: simulator 600.0 ms vs real 950.0 ms "
        "(-37%, gate ±36%: the target 25% + the real runs' spread 11%)",
        "queueing TTFT p99: simulator 749.0 ms vs real 1500.0 ms "
        "(-50%, gate ±50%: no target 50% + the real runs' spread 0%)",
    ]


def test_the_table_lists_every_real_run_the_deviations_and_both_bounds() -> None:
    text = table(build_rows(REAL, PREDICTED))
    assert (
        "| light | TTFT p50 | 200.0 / 220.0 / 260.0 | 27% | 258.0 (+17%) | 170.0 (-23%) | ±15% | yes | no | ±42% |"
        in text
    )
    assert "| queueing | TTFT p99 | 1500.0 / 1500.0 | 0% | 1000.0 (-33%) | 760.0 (-49%) | - | - | - | ±50% |" in text


def test_an_ungated_source_and_metric_is_reported_but_not_judged() -> None:
    r = Row("light", "ttft", "p50", (0.072, 0.064, 0.072), {"emulator": 0.0589, "simulator": 0.0499})
    assert [line.split(":")[1].split()[0] for line in failures([r])] == ["simulator"]  # -31% against ±26%
    assert failures([r], ungated={("simulator", "ttft")}) == []
    assert failures([r], ungated={("simulator", "tpot")}) == failures([r])  # only the named metric is let off
    assert failures([r], ungated={("simulator", "ttft", "light")}) == []  # at the named load
    assert failures([r], ungated={("simulator", "ttft", "queueing")}) == failures([r])  # only at that load
    assert failures([r], ungated={("simulator", "ttft", "light", "p50")}) == []  # that one row
    assert failures([r], ungated={("simulator", "ttft", "light", "p99")}) == failures([r])  # only that row
