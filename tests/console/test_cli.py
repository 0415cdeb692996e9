"""The CLI end to end (sim, runs, bench) through Typer's runner, on real SQLite files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli import _register_commands, app

_register_commands()
runner = CliRunner()
KEYS = {
    "policy",
    "requests",
    "throughput_tok_s",
    "ttft_p50",
    "ttft_p99",
    "tpot_mean",
    "tpot_p50",
    "tpot_p99",
    "tpot_p999",
    "slo_attainment",
    "optimal_assignment_ratio",
    "run_id",
}


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout


def test_sim_json_records_one_run_per_policy(tmp_path: Path) -> None:
    db = str(tmp_path / "runs.db")
    code, out = invoke(
        "sim",
        "--workload",
        "random",
        "--requests",
        "300",
        "--rate",
        "2",
        "--cluster",
        "2P8D",
        "--policy",
        "sibyl",
        "--policy",
        "least_load",
        "--param",
        "least_load.by=tokens",
        "--db",
        db,
        "--json",
    )
    assert code == 0, out
    rows = json.loads(out)
    assert [r["policy"] for r in rows] == ["sibyl", "least_load"]
    assert all(r.keys() >= KEYS for r in rows)
    assert rows[1]["params"] == {"by": "tokens"} and rows[0]["requests"] == 300
    assert 0 < rows[0]["tpot_p50"] <= rows[0]["tpot_p99"] <= rows[0]["tpot_p999"]
    code, out = invoke("runs", "list", "--db", db, "--json")
    listed = json.loads(out)
    assert {r["run_id"] for r in listed} == {r["run_id"] for r in rows}
    assert all(
        {"run_id", "started_at", "ended_at", "status", "backend", "policy", "requests"} <= r.keys() for r in listed
    )
    assert all(r["status"] == "completed" and r["requests"] == 300 for r in listed)
    code, out = invoke("runs", "show", rows[0]["run_id"], "--db", db, "--json")
    shown = json.loads(out)
    assert shown["policy_events"][0]["new"] == "sibyl" and sum(shown["requests_per_decode"].values()) == 300


def test_sim_reads_a_trace_file(tmp_path: Path) -> None:
    trace = Path(__file__).parents[1] / "data" / "traces" / "azure_sample.csv"
    code, out = invoke("sim", str(trace), "--cluster", "1P2D", "--policy", "round_robin", "--no-db", "--json")
    assert code == 0, out
    assert json.loads(out)[0]["run_id"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "--cluster", "4X"], "expected <prefill>P<decode>D"),
        (["sim", "--policy", "nope", "--no-db"], "unknown routing policy 'nope'; available: "),
        (["sim", "--profile", "nope", "--no-db"], "built-in profiles"),
        (["sim", "--param", "sibyl.bogus=1", "--no-db", "--requests", "10"], "bogus"),
        (["runs", "show", "r-nope"], "unknown run"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, [*args, *(["--db", str(tmp_path / "x.db")] if args[0] == "runs" else [])])
    assert result.exit_code != 0
    assert message in str(result.exception)


def test_bench_decision_json() -> None:
    code, out = invoke(
        "bench",
        "decision",
        "--policy",
        "sibyl",
        "--decode-instances",
        "8",
        "--running-per-instance",
        "8",
        "--iterations",
        "50",
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert data["tracked_requests"] == 8 * (8 + 4) and 0 < data["p50_us"] <= data["p99_us"]


def test_bench_rank_times_an_admission_round_of_each_rank_policy() -> None:
    code, out = invoke(
        "bench",
        "rank",
        "--policy",
        "bf_io",
        "--policy",
        "jsq:by=requests",
        "--ranks",
        "4",
        "--slots",
        "8",
        "--waiting",
        "16",
        "--free-per-rank",
        "2",
        "--rounds",
        "10",
        "--json",
    )
    assert code == 0, out
    rows = json.loads(out)
    assert [r["policy"] for r in rows] == ["bf_io", "jsq:by=requests"]
    assert all(r["rounds"] == 10 and r["admitted"] == 8 and 0 < r["p50_us"] <= r["p99_us"] for r in rows)
    code, out = invoke("bench", "rank", "--policy", "bf_io:horizon=-1")
    assert code != 0


def test_policy_list_works_without_a_console(sibyl_home: Path) -> None:  # no console announced there
    code, out = invoke("policy", "list", "--json")
    assert code == 0
    listed = json.loads(out)
    assert listed["active"] == {}
    by_kind: dict[str, set[str]] = {}
    for p in listed["available"]:
        by_kind.setdefault(p["kind"], set()).add(p["name"])
    assert by_kind["queue"] >= {"fcfs", "priority"} and by_kind["scaling"] >= {"static", "threshold"}
    assert by_kind["reschedule"] >= {"none"} and by_kind["routing"] >= {"least_load", "sibyl", "clairvoyant"}
    assert next(p for p in listed["available"] if p["name"] == "clairvoyant")["sim_only"] is True
    code, out = invoke("policy", "list", "--kind", "scaling")
    assert code == 0 and "threshold" in out and "no console running" in out


def test_the_root_help_lists_emulate_with_its_own_summary_without_loading_it() -> None:
    """The root --help names `emulate` by the first line of its real help, and loads neither the
    emulator's settings nor the profiles (NumPy) to do so."""
    import subprocess
    import sys

    from adapters.emulator.cli import HELP
    from console.commands.emulate import SUMMARY

    assert HELP.splitlines()[0] == SUMMARY
    probe = (
        "import sys; sys.argv = ['sibyl-console', '--help']\n"
        "from console.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', 'numpy' in sys.modules, 'adapters.emulator.settings' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "LOADED False False" in done.stdout, done.stdout[-500:] + done.stderr[-500:]
    assert "emulate" in done.stdout


def test_advise_help_shows_the_advisor_table_literally() -> None:
    """Typer renders help through rich markup, where an unescaped `[advisor]` is a tag and vanishes."""
    result = runner.invoke(app, ["advise", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "`[advisor] enabled = true`" in result.stdout
