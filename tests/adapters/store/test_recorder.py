"""The recorder buffers advisor events beside request rows with the columns of schema 9, writes them on flush,
and a bad advisor event costs only itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.store import RunRecorder, RunStore


def test_advisor_events_and_new_request_columns_go_through_the_recorder(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    rec = RunRecorder(store, rid, flush_interval_s=60)
    rec.request({"request_id": "a", "status": "ok", "model": "m", "arm": "control", "prefix_keys": (1, 2)})
    rec.advisor_event(
        t=30.0, event="advice", kind="routing", policy="sibyl", decision="suggest", data={"best": "sibyl"}
    )
    rec.advisor_event(t=31.0, event="canary_start", canary="c1", kind="routing", policy="sibyl")
    with pytest.raises(ValueError, match="unknown advisor event"):
        rec.advisor_event(t=32.0, event="advise")
    assert store.advisor_events(rid) == []  # buffered until the flush
    rec.close(status="completed")
    again = RunStore(tmp_path / "runs.db")
    assert [(e["event"], e["policy"], e["data"]) for e in again.advisor_events(rid)] == [
        ("advice", "sibyl", {"best": "sibyl"}),
        ("canary_start", "sibyl", {}),
    ]
    [row] = again.requests(rid)
    assert (row["model"], row["arm"], row["prefix_keys"]) == ("m", "control", (1, 2))


def test_a_request_whose_keys_cannot_be_packed_costs_only_itself(tmp_path: Path) -> None:
    """Keys that are not ints fail the batch; written one by one, the advisor event and the other row stay."""
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    rec = RunRecorder(store, rid, flush_interval_s=60)
    rec.request({"request_id": "bad", "status": "ok", "prefix_keys": ("not", "ints")})
    rec.request({"request_id": "good", "status": "ok", "prefix_keys": (3,)})
    rec.advisor_event(t=1.0, event="canary_end", canary="c1", decision="interrupted", detail="the console stopped")
    rec.close(status="completed")
    assert [r["request_id"] for r in store.requests(rid)] == ["good"]
    assert [e["decision"] for e in store.advisor_events(rid)] == ["interrupted"]
