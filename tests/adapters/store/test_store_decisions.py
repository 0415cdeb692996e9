"""Decision records in the run store: a round trip through the recorder on a real SQLite file, and a
store written before the decisions table (schema 6) upgraded in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from adapters.store import RunRecorder, RunStore
from adapters.store.recorder import decision_row
from adapters.store.schema import SCHEMA_VERSION
from core.decision_records import Decision, Record


def decision(rid: str, t: float) -> Decision:
    return Decision.of(
        "route",
        "decode",
        "sibyl",
        t,
        request_id=rid,
        chosen="d1",
        score_name="projected_load_at_tau",
        names=["d0", "d1", "d2"],
        scores=[2.0, 0.5, 0.5],
        features={"running": [2.0, 0.0, 0.0], "cached_tokens": [0.0, 16.0, float("nan")]},
        info={"tau_in_s": 0.25},
    )


def test_decisions_round_trip_through_the_recorder(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    run = store.create_run(kind="live", backend="emulator")
    rec = RunRecorder(store, run, flush_interval_s=60)
    rec.decisions([Record.of(decision("a", 100.5)), Record.of(decision("b", 101.0))], t0=100.0)
    rec.close(status="completed")
    again = RunStore(tmp_path / "runs.db")
    rows = again.decisions(run, "a")
    assert len(rows) == 1 and again.decision_count(run) == 2
    r = rows[0]
    assert (r["t"], r["kind"], r["stage"], r["policy"], r["chosen"]) == (0.5, "route", "decode", "sibyl", "d1")
    assert r["margin"] == 0.0 and r["ties"] == 1  # d2 ties with d1 and r["info"] == {"tau_in_s": 0.25}
    assert [c["name"] for c in r["candidates"]] == ["d0", "d1", "d2"]
    assert r["candidates"][1] == {
        "name": "d1",
        "score": 0.5,
        "eligible": True,
        "chosen": True,
        "features": {"running": 0.0, "cached_tokens": 16.0},
    }
    assert r["candidates"][2]["features"]["cached_tokens"] is None  # NaN is stored as null


def test_a_store_from_before_the_decisions_table_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    RunStore(path).close()
    con = sqlite3.connect(path)
    con.execute("DROP TABLE decisions")
    for (name,) in con.execute("SELECT name FROM pragma_table_info('requests')").fetchall():
        if name in ("tenant", "model", "lora", "arm", "session", "prefix_keys"):  # schema 8's and 9's (not at 6)
            con.execute(f"ALTER TABLE requests DROP COLUMN {name}")
    con.execute("ALTER TABLE policy_events DROP COLUMN pool")  # schema 10's
    con.execute("ALTER TABLE instance_samples DROP COLUMN health_rtt_s")  # schema 11's
    con.execute("PRAGMA user_version = 6")
    con.commit()
    con.close()
    store = RunStore(path)
    run = store.create_run(kind="live", backend="emulator")
    store.add_decisions(run, [decision_row(Record.of(decision("x", 1.0)))])
    assert store.decisions(run)[0]["candidates"][1]["chosen"]
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 7
    con.close()
