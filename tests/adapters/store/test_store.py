"""The run store's request columns of schema 9 (model, lora, arm, session, prefix_keys) and its advisor events,
on real SQLite files: what goes in comes back, what is left out is NULL, a 100k insert with keys stays fast."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.store import RunStore


def test_request_columns_round_trip_and_default_to_null(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    store.add_requests(
        rid,
        [
            {
                "request_id": "a",
                "status": "ok",
                "model": "llama-3b",
                "lora": "sql",
                "arm": "canary",
                "session": "conv-1",
                "prefix_keys": [11, -22, 33],
            },
            {"request_id": "b", "status": "ok", "model": "llama-3b", "prefix_keys": ()},  # no full block
            {"request_id": "c", "status": "failed"},  # a writer that knows none of them
        ],
    )
    store.close()
    rows = RunStore(tmp_path / "runs.db").requests(rid)
    picked = [(r["model"], r["lora"], r["arm"], r["session"], r["prefix_keys"]) for r in rows]
    assert picked == [
        ("llama-3b", "sql", "canary", "conv-1", (11, -22, 33)),
        ("llama-3b", None, None, None, ()),
        (None, None, None, None, None),
    ]


def test_write_batch_packs_request_keys_and_writes_advisor_events(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    from adapters.store.store import advisor_row

    store.write_batch(
        rid,
        [{"request_id": "a", "status": "ok", "prefix_keys": (7, 8)}],
        [],
        [],
        [],
        advisor_events=[advisor_row(t=30.0, event="advice", kind="routing", policy=None, detail="none beats")],
    )
    assert store.requests(rid)[0]["prefix_keys"] == (7, 8)
    [event] = store.advisor_events(rid)
    assert (event["t"], event["event"], event["policy"], event["detail"], event["data"]) == (
        30.0,
        "advice",
        None,
        "none beats",
        {},
    )


def test_advisor_events_round_trip_filtered_by_kind(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    other = store.create_run(kind="live", backend="emulator")
    plan = {"kind": "routing", "name": "sibyl", "share": 0.1, "duration_s": 300.0, "params": {}}
    store.add_advisor_event(rid, t=10.0, event="canary_start", canary="c1", kind="routing", policy="sibyl", data=plan)
    store.add_advisor_event(
        rid, t=40.0, event="canary_reading", canary="c1", decision="continue", data={"canary_n": 12, "nan": None}
    )
    store.add_advisor_event(
        rid, t=310.0, event="canary_end", canary="c1", decision="promote", detail="the canary is better"
    )
    store.add_advisor_event(other, t=1.0, event="advice", policy="least_load")
    rows = store.advisor_events(rid)
    assert [(e["event"], e["decision"]) for e in rows] == [
        ("canary_start", None),
        ("canary_reading", "continue"),
        ("canary_end", "promote"),
    ]
    assert rows[0]["data"] == plan and rows[1]["data"] == {"canary_n": 12, "nan": None}
    assert [e["t"] for e in store.advisor_events(rid, "canary_end")] == [310.0]
    assert [e["policy"] for e in store.advisor_events(other)] == ["least_load"]


def test_an_unknown_advisor_event_is_refused_at_the_call(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    with pytest.raises(ValueError, match="unknown advisor event 'canary_begin'; events: advice, canary_start"):
        store.add_advisor_event(rid, t=1.0, event="canary_begin")
    assert store.advisor_events(rid) == []


def test_bulk_insert_of_requests_with_prefix_keys(tmp_path: Path) -> None:
    """The columns of schema 9 filled on every row, 32 keys each: written in bulk and read back whole
    (the speed of this path is benchmarks' business, not a test's)."""
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="sim", backend="sim")
    rows = [
        {
            "request_id": str(i),
            "arrival": i / 10,
            "status": "ok",
            "model": "llama",
            "lora": f"a{i % 50}",
            "arm": "canary" if i % 10 == 0 else "control",
            "session": f"s{i // 4}",
            "prefix_keys": tuple(range(i, i + 32)),
        }
        for i in range(20_000)
    ]
    store.add_requests(rid, rows)
    back = store.requests(rid)
    assert len(back) == 20_000 and back[-1]["prefix_keys"] == tuple(range(19_999, 20_031))
    picked = (back[20]["lora"], back[20]["arm"], back[21]["arm"], back[21]["session"])
    assert picked == ("a20", "canary", "control", "s5")
