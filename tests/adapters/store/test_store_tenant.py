"""Schema 8: requests.tenant, added to a store written before it (schema 6) without touching its rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from adapters.store import RunStore
from adapters.store.schema import SCHEMA_VERSION


def test_a_store_of_schema_6_gains_requests_tenant(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    store = RunStore(path)
    old = store.create_run(kind="live", backend="emulator")
    store.add_requests(old, [{"request_id": "r0", "status": "ok"}])
    store.close()
    with sqlite3.connect(path) as con:
        for column in ("tenant", "model", "lora", "arm", "session", "prefix_keys"):  # schema 8's and 9's
            con.execute(f"ALTER TABLE requests DROP COLUMN {column}")
        con.execute("ALTER TABLE policy_events DROP COLUMN pool")  # schema 10's
        con.execute("ALTER TABLE instance_samples DROP COLUMN health_rtt_s")  # schema 11's
        con.execute("PRAGMA user_version = 6")
    store = RunStore(path)
    assert store.requests(old)[0]["tenant"] is None
    store.add_requests(old, [{"request_id": "r1", "status": "ok", "tenant": "team-a"}])
    assert [r["tenant"] for r in store.requests(old)] == [None, "team-a"]
    store.close()
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 8
