"""`runs why` through Typer's runner on a run store filled by a real dispatcher's decision records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adapters.store import RunRecorder, RunStore
from console.cli import _register_commands, app
from core.decision_log import DecisionLog
from core.types import Request
from tests.helpers import add_running, cluster

_register_commands()
runner = CliRunner()


def filled(tmp_path: Path, sample_rate: float = 1.0) -> tuple[str, str]:
    """A run whose dispatcher routed r0..r3 with sibyl over 3 decode instances (records sampled at
    `sample_rate`), and whose request rows say where each went."""
    db = tmp_path / "runs.db"
    store = RunStore(db)
    run = store.create_run(kind="live", backend="emulator", config={"decisions": {"sample_rate": sample_rate}})
    rec = RunRecorder(store, run, flush_interval_s=60)
    d = cluster("sibyl", decode=3)
    d.use_decisions(DecisionLog(sample_rate=sample_rate, sink=rec.decisions))
    add_running(d, "busy", "d0", prompt=100, generated=5, rate=10.0, now=0.0)
    for k in range(4):
        a = d.route(Request(f"r{k}", 0.1 * k, 100, 20), 0.1 * k)
        d.on_prefill_end(f"r{k}", 0.1 * k + 0.05)
        d.on_decode_start(f"r{k}", 0.1 * k + 0.05)
        rec.request(
            {
                "request_id": f"r{k}",
                "arrival": 0.1 * k,
                "prefill_start": 0.1 * k,
                "prefill_end": 0.1 * k + 0.05,
                "decode_start": 0.1 * k + 0.05,
                "finish": 0.1 * k + 1,
                "prompt_tokens": 100,
                "output_tokens": 20,
                "prefill_instance": a.prefill,
                "decode_instance": a.decode,
                "status": "ok",
            }
        )
    rec.close(
        status="completed", summary={"decision_quality": {"records": d.decisions.counts() if d.decisions else {}}}
    )
    return str(db), run


def test_runs_why_prints_the_timeline_and_every_candidate(tmp_path: Path) -> None:
    db, run = filled(tmp_path)
    result = runner.invoke(app, ["runs", "why", run, "r1", "--db", db])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "timeline" in out and "prefill_end" in out and "route decode: d" in out
    assert "route decode by sibyl" in out and "projected_load_at_tau" in out
    for name in ("d0", "d1", "d2", "p0"):
        assert name in out
    assert "handoff decode" in out and "still_best=" in out

    result = runner.invoke(app, ["runs", "why", run, "r1", "--db", db, "--json"])
    data = json.loads(result.output)
    route = [x for x in data["decisions"] if (x["kind"], x["stage"]) == ("route", "decode")][0]
    assert [c["name"] for c in route["candidates"]] == ["d0", "d1", "d2"]
    assert route["chosen"] == data["request"]["decode_instance"]
    assert all({"running", "pending", "cached_tokens"} <= set(c["features"]) for c in route["candidates"])
    assert [e["t"] for e in data["timeline"]] == sorted(e["t"] for e in data["timeline"])


@pytest.mark.parametrize(
    ("sample_rate", "request_id", "message"),
    [
        (1.0, "nope", "is not in run"),
        (0.5, "r0", "sampling dropped them (sample_rate 0.5"),
        (0.0, "r0", "recorded no decisions"),
    ],
)
def test_runs_why_says_why_there_is_nothing(tmp_path: Path, sample_rate: float, request_id: str, message: str) -> None:
    db, run = filled(tmp_path, sample_rate)
    result = runner.invoke(app, ["runs", "why", run, request_id, "--db", db])
    assert result.exit_code != 0
    assert message in str(result.exception)
    result = runner.invoke(app, ["runs", "why", "r-unknown", "r0", "--db", db])
    assert "unknown run" in str(result.exception)
