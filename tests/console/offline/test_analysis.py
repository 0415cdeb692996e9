"""`runs compare`, `runs export` and `runs plot` on runs recorded in the test."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli import _register_commands, app

_register_commands()
runner = CliRunner()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    db = str(tmp_path_factory.mktemp("runs") / "runs.db")
    r = runner.invoke(
        app,
        [
            "sim",
            "--workload",
            "random",
            "--requests",
            "400",
            "--rate",
            "3",
            "--cluster",
            "2P6D",
            "--policy",
            "round_robin",
            "--policy",
            "least_load",
            "--db",
            db,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.stdout
    return db, [row["run_id"] for row in json.loads(r.stdout)]


def test_compare_reports_relative_differences(two_runs: tuple[str, list[str]]) -> None:
    db, ids = two_runs
    r = runner.invoke(app, ["runs", "compare", *ids, "--db", db, "--json"])
    assert r.exit_code == 0, r.stdout
    base, other = json.loads(r.stdout)
    assert base["run"]["policy"] == "round_robin" and other["run"]["policy"] == "least_load"
    assert base["relative"]["tpot_p99"] == 0.0
    expected = other["metrics"]["tpot_p99"] / base["metrics"]["tpot_p99"] - 1
    assert other["relative"]["tpot_p99"] == pytest.approx(expected)
    assert base["metrics"]["requests"] == 400 and other["policy_timeline"][0].startswith("0s least_load")
    assert base["metrics"]["tpot_unknown"] == other["metrics"]["tpot_unknown"] == 0  # the simulator measures every TPOT
    table = runner.invoke(app, ["runs", "compare", *ids, "--db", db])
    assert table.exit_code == 0 and "tpot_p99" in table.stdout
    assert runner.invoke(app, ["runs", "compare", ids[0], "--db", db]).exit_code != 0


def test_csv_export_round_trips(two_runs: tuple[str, list[str]], tmp_path: Path) -> None:
    db, ids = two_runs
    out = tmp_path / "run.csv"
    r = runner.invoke(app, ["runs", "export", ids[0], "--format", "csv", "--out", str(out), "--db", db])
    assert r.exit_code == 0, r.stdout
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    from adapters.store import RunStore

    stored = RunStore(db).requests(ids[0])
    assert len(rows) == len(stored) == 400
    assert [float(x["tpot"]) for x in rows] == pytest.approx([s["tpot"] for s in stored])
    assert [x["decode_instance"] for x in rows] == [s["decode_instance"] for s in stored]
    as_json = json.loads(runner.invoke(app, ["runs", "export", ids[0], "--format", "json", "--db", db]).stdout)
    assert len(as_json) == 400 and as_json[0]["request_id"] == stored[0]["request_id"]
    assert runner.invoke(app, ["runs", "export", ids[0], "--format", "xml", "--db", db]).exit_code != 0


@pytest.mark.parametrize("metric", ["tpot", "ttft", "attainment"])
def test_plot_writes_a_png_and_draws_in_the_terminal(
    two_runs: tuple[str, list[str]], tmp_path: Path, metric: str
) -> None:
    db, ids = two_runs
    png = tmp_path / f"{metric}.png"
    r = runner.invoke(app, ["runs", "plot", ids[1], "--metric", metric, "--out", str(png), "--db", db])
    assert r.exit_code == 0, r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    term = runner.invoke(app, ["runs", "plot", ids[1], "--metric", metric, "--db", db])
    assert term.exit_code == 0 and metric in term.stdout


def test_plot_errors(two_runs: tuple[str, list[str]]) -> None:
    db, ids = two_runs
    r = runner.invoke(app, ["runs", "plot", ids[0], "--metric", "load", "--db", db])
    assert r.exit_code != 0 and "no data for load" in str(r.exception)  # simulated runs have no instance samples
    r = runner.invoke(app, ["runs", "plot", ids[0], "--metric", "vibes", "--db", db])
    assert r.exit_code != 0 and "metrics: tpot, ttft, attainment, load" in str(r.exception)


def test_run_metrics_leave_unmeasured_tpot_out() -> None:
    """Whole replies stored with a NULL TPOT: out of the TPOT percentiles, counted, judged on TTFT."""
    from console.commands.runs import _summary_value
    from console.offline.analysis import run_metrics

    def row(ttft: float, tpot: float | None, finish: float) -> dict[str, object]:
        return {
            "status": "ok",
            "ttft": ttft,
            "tpot": tpot,
            "arrival": 0.0,
            "finish": finish,
            "output_tokens": 10,
            "slo_met": None,
        }

    rows = [row(0.5, None, 1.0), row(0.5, 0.02, 2.0), row(0.5, 0.04, 3.0), row(5.0, None, 4.0)]
    m = run_metrics(rows)
    assert m["tpot_unknown"] == 2 and m["tpot_p50"] == pytest.approx(0.03) and m["tpot_mean"] == pytest.approx(0.03)
    assert m["slo_attainment"] == pytest.approx(3 / 4)  # the slow-TTFT whole reply is the one miss
    only_whole = run_metrics([row(0.5, None, 1.0)])
    assert only_whole["tpot_p99"] is None and only_whole["tpot_mean"] is None and only_whole["slo_attainment"] == 1.0
    assert [_summary_value(v) for v in (None, float("nan"), 0.12345, 3)] == ["-", "-", "0.1235", "3"]
