"""Schema 9 upgrades: a store written by schema 8 (its tables created here as schema 8 created them) and one
written by schema 6 open, gain the request columns model, lora, arm, session and prefix_keys and the
advisor_events table, and lose nothing already recorded."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from adapters.store import RunStore
from adapters.store.schema import SCHEMA_VERSION

SCHEMA_8 = [
    """CREATE TABLE runs (
        run_id VARCHAR NOT NULL, kind VARCHAR NOT NULL, started_at FLOAT NOT NULL, ended_at FLOAT,
        status VARCHAR NOT NULL, backend VARCHAR NOT NULL, cluster VARCHAR NOT NULL, workload VARCHAR NOT NULL,
        seed INTEGER, policy VARCHAR NOT NULL, config VARCHAR NOT NULL, pid INTEGER, parent_run_id VARCHAR,
        notes VARCHAR NOT NULL, summary VARCHAR, sweep VARCHAR, PRIMARY KEY (run_id))""",
    """CREATE TABLE requests (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, request_id VARCHAR NOT NULL, arrival FLOAT,
        prompt_tokens INTEGER, output_tokens INTEGER, max_tokens INTEGER, slo_class VARCHAR, priority INTEGER,
        prefill_instance VARCHAR, decode_instance VARCHAR, dp_rank INTEGER, queued FLOAT, prefill_start FLOAT,
        prefill_end FLOAT, decode_start FLOAT, first_token FLOAT, finish FLOAT, ttft FLOAT, tpot FLOAT,
        ttft_source VARCHAR, e2e FLOAT, cached_tokens INTEGER, status VARCHAR NOT NULL, reason VARCHAR,
        slo_met BOOLEAN, tenant VARCHAR, PRIMARY KEY (id))""",
    """CREATE TABLE policy_events (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, t FLOAT NOT NULL, kind VARCHAR NOT NULL, old VARCHAR,
        new VARCHAR NOT NULL, params VARCHAR NOT NULL, source VARCHAR NOT NULL, PRIMARY KEY (id))""",
]
NEW_REQUEST_COLUMNS = ("model", "lora", "arm", "session", "prefix_keys")


def write_schema_8_store(path: Path) -> None:
    """A store as sibyl-console with schema 8 left it: one finished run, two requests, one policy event."""
    with sqlite3.connect(path) as con:
        for ddl in SCHEMA_8:
            con.execute(ddl)
        con.execute(
            "INSERT INTO runs VALUES ('r-old', 'live', 100.0, 160.0, 'completed', 'emulator', '1P1D', '', 7, "
            "'sibyl', '{\"a\": 1}', NULL, NULL, '', '{\"tpot_p99\": 0.05}', NULL)"
        )
        con.execute(
            "INSERT INTO requests (run_id, request_id, arrival, prompt_tokens, ttft, tpot, status, slo_met, tenant) "
            "VALUES ('r-old', 'a', 0.5, 100, 0.2, 0.02, 'ok', 1, 'team-a'), "
            "('r-old', 'b', 1.5, 50, NULL, NULL, 'failed', 0, 'default')"
        )
        con.execute(
            "INSERT INTO policy_events (run_id, t, kind, old, new, params, source) "
            "VALUES ('r-old', 3.0, 'routing', 'sibyl', 'least_load', '{}', 'cli')"
        )
        con.execute("PRAGMA user_version = 8")


def columns(path: Path, table: str) -> list[str]:
    with sqlite3.connect(path) as con:
        return [row[1] for row in con.execute(f"PRAGMA table_info({table})")]


def test_a_schema_8_store_upgrades_in_place_and_keeps_its_records(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    write_schema_8_store(path)
    before = columns(path, "requests")
    store = RunStore(path)
    assert columns(path, "requests") == [*before, *NEW_REQUEST_COLUMNS]  # added at the end, nothing dropped
    assert "advisor_events" in {
        n for (n,) in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    }
    run = store.get_run("r-old")
    assert (run.status, run.requests, run.config, run.summary, run.seed) == (
        "completed",
        2,
        {"a": 1},
        {"tpot_p99": 0.05},
        7,
    )
    old = store.requests("r-old")
    assert [(r["request_id"], r["ttft"], r["slo_met"], r["tenant"]) for r in old] == [
        ("a", 0.2, True, "team-a"),
        ("b", None, False, "default"),
    ]
    assert all(r[c] is None for r in old for c in NEW_REQUEST_COLUMNS)
    assert store.policy_events("r-old")[0]["new"] == "least_load"
    assert store.advisor_events("r-old") == []
    store.add_requests(
        "r-old",
        [{"request_id": "c", "status": "ok", "model": "llama", "lora": "sql", "arm": "canary", "session": "s1",
          "prefix_keys": (5, -6)}],
    )
    store.add_advisor_event("r-old", t=9.0, event="advice", kind="routing", policy="prefix_aware", detail="gain")
    store.close()
    again = RunStore(path)  # and at the new version, opening it again changes nothing
    new = again.requests("r-old")[-1]
    assert (new["model"], new["lora"], new["arm"], new["session"], new["prefix_keys"]) == (
        "llama",
        "sql",
        "canary",
        "s1",
        (5, -6),
    )
    assert [e["policy"] for e in again.advisor_events("r-old")] == ["prefix_aware"]
    again.close()
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 9


def test_a_schema_6_store_takes_every_migration_since_in_one_open(tmp_path: Path) -> None:
    """Schema 6 had no tenant and no decisions table: 7, 8 and 9 all apply, in order."""
    path = tmp_path / "runs.db"
    write_schema_8_store(path)
    with sqlite3.connect(path) as con:
        con.execute("ALTER TABLE requests DROP COLUMN tenant")
        con.execute("PRAGMA user_version = 6")
    store = RunStore(path)
    assert columns(path, "requests")[-6:] == ["tenant", *NEW_REQUEST_COLUMNS]
    assert [r["request_id"] for r in store.requests("r-old")] == ["a", "b"]
    assert store.decision_count("r-old") == 0
    store.close()
