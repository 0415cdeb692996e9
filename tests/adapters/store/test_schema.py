"""Schema upgrades: a store written by schema 9 (its tables created here as schema 9 created them) opens and gains
policy_events.pool and instance_samples.health_rtt_s (NULL for the rows it had); one written by schema 8 (likewise)
and one by schema 6 open, gain the request columns model, lora, arm, session and prefix_keys, the advisor_events
table and the pool; none loses anything already recorded. A store of a newer schema than this one is refused,
untouched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from adapters.store import RunStore, StoreError
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
    assert [(e["new"], e["pool"]) for e in store.policy_events("r-old")] == [("least_load", None)]
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
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 11


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


SCHEMA_9 = [
    SCHEMA_8[0],
    SCHEMA_8[1].replace("tenant VARCHAR,", "tenant VARCHAR, model VARCHAR, lora VARCHAR, arm VARCHAR, session VARCHAR, "
                        "prefix_keys BLOB,"),
    SCHEMA_8[2],
    """CREATE TABLE instance_samples (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, t FLOAT NOT NULL, instance_id VARCHAR NOT NULL,
        role VARCHAR NOT NULL, healthy BOOLEAN NOT NULL, running FLOAT NOT NULL, waiting FLOAT NOT NULL,
        kv_usage FLOAT NOT NULL, tokens_per_s FLOAT NOT NULL, projected_load FLOAT, PRIMARY KEY (id))""",
    """CREATE TABLE instance_events (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, t FLOAT NOT NULL, instance_id VARCHAR NOT NULL,
        event VARCHAR NOT NULL, detail VARCHAR NOT NULL, PRIMARY KEY (id))""",
    """CREATE TABLE decisions (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, request_id VARCHAR, t FLOAT NOT NULL, kind VARCHAR NOT NULL,
        stage VARCHAR NOT NULL, policy VARCHAR NOT NULL, scorer VARCHAR NOT NULL, chosen VARCHAR,
        score_name VARCHAR NOT NULL, candidates VARCHAR NOT NULL, info VARCHAR NOT NULL, PRIMARY KEY (id))""",
    """CREATE TABLE advisor_events (
        id INTEGER NOT NULL, run_id VARCHAR NOT NULL, t FLOAT NOT NULL, event VARCHAR NOT NULL, canary VARCHAR,
        kind VARCHAR, policy VARCHAR, decision VARCHAR, detail VARCHAR NOT NULL, data VARCHAR NOT NULL,
        PRIMARY KEY (id))""",
    "CREATE INDEX ix_runs_sweep ON runs (sweep)",
    "CREATE INDEX ix_runs_status ON runs (status)",
    "CREATE INDEX ix_requests_run_id ON requests (run_id)",
    "CREATE INDEX ix_policy_events_run_id ON policy_events (run_id)",
    "CREATE INDEX ix_instance_samples_run_id ON instance_samples (run_id)",
    "CREATE INDEX ix_instance_events_run_id ON instance_events (run_id)",
    "CREATE INDEX ix_decisions_request_id ON decisions (request_id)",
    "CREATE INDEX ix_decisions_run_id ON decisions (run_id)",
    "CREATE INDEX ix_advisor_events_run_id ON advisor_events (run_id)",
]
"""Every table and index of schema 9 as it created them (policy_events without its pool)."""


def write_schema_9_store(path: Path) -> None:
    """A store as sibyl-console with schema 9 left it: a finished two-pool run (its summary with the first pool's
    decision quality only), a request of each model, a policy event of each kind, an instance sample and event, a
    decision record and an advice."""
    with sqlite3.connect(path) as con:
        for ddl in SCHEMA_9:
            con.execute(ddl)
        con.execute(
            "INSERT INTO runs VALUES ('r-9', 'live', 100.0, 160.0, 'completed', 'emulator', '2P2D', '', NULL, "
            "'round_robin', '{}', NULL, NULL, '', '{\"decision_quality\": {\"decode_scored\": 3}}', NULL)"
        )
        con.execute(
            "INSERT INTO requests (run_id, request_id, arrival, status, slo_met, model, lora, prefix_keys) "
            "VALUES ('r-9', 'a', 0.5, 'ok', 1, 'A', 'sql', x'0500000000000000'), "
            "('r-9', 'b', 1.5, 'ok', 1, 'B', NULL, NULL)"
        )
        con.execute(
            "INSERT INTO policy_events (run_id, t, kind, old, new, params, source) "
            "VALUES ('r-9', 0.0, 'routing', NULL, 'round_robin', '{}', 'config'), "
            "('r-9', 3.0, 'routing', 'round_robin', 'least_load', '{\"by\": \"tokens\"}', 'cli')"
        )
        con.execute(
            "INSERT INTO instance_samples (run_id, t, instance_id, role, healthy, running, waiting, kv_usage, "
            "tokens_per_s) VALUES ('r-9', 1.0, 'A.d0', 'decode', 1, 2, 0, 0.5, 40.0)"
        )
        con.execute("INSERT INTO instance_events (run_id, t, instance_id, event, detail) "
                    "VALUES ('r-9', 2.0, 'B.d0', 'down', 'refused')")
        con.execute(
            "INSERT INTO decisions (run_id, request_id, t, kind, stage, policy, scorer, chosen, score_name, "
            "candidates, info) VALUES ('r-9', 'a', 0.5, 'route', 'prefill', 'round_robin', '', 'A.p0', '', "
            "'{\"names\": [\"A.p0\"], \"scores\": null, \"eligible\": [true], \"features\": {}}', '{}')"
        )
        con.execute("INSERT INTO advisor_events (run_id, t, event, detail, data) "
                    "VALUES ('r-9', 30.0, 'advice', 'no gain', '{}')")
        con.execute("PRAGMA user_version = 9")


def test_a_schema_9_store_gains_the_policy_events_pool_and_the_samples_round_trip_and_keeps_its_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    write_schema_9_store(path)
    tables = ("runs", "requests", "policy_events", "instance_samples", "decisions", "advisor_events")
    before = {t: columns(path, t) for t in tables}
    store = RunStore(path)
    after = {t: columns(path, t) for t in before}
    assert after == {  # added at the end, only they
        **before,
        "policy_events": [*before["policy_events"], "pool"],
        "instance_samples": [*before["instance_samples"], "health_rtt_s"],
    }
    run = store.get_run("r-9")
    assert (run.status, run.requests, run.cluster, run.summary) == (
        "completed",
        2,
        "2P2D",
        {"decision_quality": {"decode_scored": 3}},
    )
    assert [(r["request_id"], r["model"], r["lora"], r["prefix_keys"]) for r in store.requests("r-9")] == [
        ("a", "A", "sql", (5,)),
        ("b", "B", None, None),
    ]
    assert [(e["t"], e["new"], e["params"], e["source"], e["pool"]) for e in store.policy_events("r-9")] == [
        (0.0, "round_robin", {}, "config", None),
        (3.0, "least_load", {"by": "tokens"}, "cli", None),
    ]
    assert store.instance_samples("r-9")[0]["kv_usage"] == 0.5 and store.instance_events("r-9")[0]["event"] == "down"
    assert store.instance_samples("r-9")[0]["health_rtt_s"] is None
    [decision] = store.decisions("r-9")
    assert (decision["request_id"], decision["chosen"]) == ("a", "A.p0")
    assert [e["detail"] for e in store.advisor_events("r-9")] == ["no gain"]
    store.add_policy_event("r-9", t=9.0, kind="routing", old="round_robin", new="sibyl", params={}, source="api",
                           pool="B")
    sample = {"t": 4.0, "instance_id": "A.d0", "role": "decode", "healthy": True, "running": 0, "waiting": 0}
    store.add_instance_samples("r-9", [{**sample, "kv_usage": 0.1, "tokens_per_s": 0.0, "health_rtt_s": 0.0012}])
    store.close()
    again = RunStore(path)  # at the new version, opening it again changes nothing
    assert [e["pool"] for e in again.policy_events("r-9")] == [None, None, "B"]
    assert [s["health_rtt_s"] for s in again.instance_samples("r-9")] == [None, 0.0012]
    again.close()
    assert columns(path, "policy_events") == after["policy_events"]
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 11


def test_a_store_of_a_newer_schema_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    write_schema_9_store(path)
    with sqlite3.connect(path) as con:
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = columns(path, "policy_events")
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1} is newer than this sibyl-console "
                                         rf"\({SCHEMA_VERSION}\); upgrade"):
        RunStore(path)
    assert columns(path, "policy_events") == before  # no pool added to a store this version does not know
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
