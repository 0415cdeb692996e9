"""The SQLite run store on real files: every table round-trips, bulk inserts, the recorder, interrupted runs; the
request columns of schema 9 (model, lora, arm, session, prefix_keys) and its advisor events, the policy events' pool
of schema 10: what goes in comes back, what is left out is NULL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adapters.store import RunRecorder, RunStore, StoreError

ROOT = Path(__file__).resolve().parents[3]


def test_every_table_round_trips(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(
        kind="live", backend="emulator", cluster="2P4D", workload="w", seed=3, policy="sibyl", config={"a": 1}
    )
    store.add_requests(
        rid, [{"request_id": "x", "arrival": 0.5, "prompt_tokens": 10, "status": "ok", "ttft": 0.1, "slo_met": True}]
    )
    store.add_policy_event(
        rid, t=1.5, kind="routing", old="sibyl", new="least_load", params={"by": "tokens"}, source="cli"
    )
    store.add_instance_samples(
        rid,
        [
            {
                "t": 1.0,
                "instance_id": "d0",
                "role": "decode",
                "healthy": True,
                "running": 3,
                "waiting": 1,
                "kv_usage": 0.25,
                "tokens_per_s": 99.0,
            }
        ],
    )
    store.add_instance_event(rid, t=2.0, instance_id="d0", event="down", detail="ClientConnectorError")
    store.finish_run(rid, "completed", {"tpot_p99": 0.05})
    run = store.get_run(rid)
    assert (run.status, run.requests, run.config, run.summary, run.cluster, run.seed) == (
        "completed",
        1,
        {"a": 1},
        {"tpot_p99": 0.05},
        "2P4D",
        3,
    )
    assert store.requests(rid)[0]["slo_met"] is True and store.requests(rid)[0]["arrival"] == 0.5
    store.add_policy_event(rid, t=2.5, kind="queue", old="fcfs", new="priority", params={}, source="api", pool="B")
    ev, pooled = store.policy_events(rid)
    assert (ev["new"], ev["params"], ev["source"], ev["pool"]) == ("least_load", {"by": "tokens"}, "cli", None)
    assert (pooled["kind"], pooled["new"], pooled["pool"]) == ("queue", "priority", "B")
    assert store.instance_samples(rid)[0]["kv_usage"] == 0.25
    assert store.instance_events(rid)[0]["event"] == "down"
    store.close()
    assert RunStore(tmp_path / "runs.db").get_run(rid).status == "completed"  # persisted


@pytest.mark.slow  # ~7 s (make test-slow); a bulk insert in the default suite: the 20k rows with keys below
def test_bulk_insert_of_100k_requests(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="sim", backend="sim")
    store.add_requests(rid, [{"request_id": str(i), "arrival": i / 10, "status": "ok"} for i in range(100_000)])
    rows = store.requests(rid)
    assert len(rows) == 100_000 and rows[-1]["request_id"] == "99999" and rows[12]["arrival"] == 1.2
    assert store.list_runs()[0].requests == 100_000


def test_in_memory_store() -> None:
    store = RunStore(":memory:")
    rid = store.create_run(kind="sim", backend="sim")
    assert store.get_run(rid).status == "running"


def test_unknown_and_ambiguous_ids_are_clear_errors(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    a = store.create_run(kind="sim", backend="sim")
    store.create_run(kind="sim", backend="sim")
    with pytest.raises(StoreError, match=f"unknown run 'nope'.*recent runs: .*{a}"):
        store.get_run("nope")
    with pytest.raises(StoreError, match="ambiguous"):
        store.get_run("r-")
    assert store.get_run(a[:-1]).run_id == a or store.get_run(a).run_id == a


def test_unusable_file_names_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "runs.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match=str(bad)):
        RunStore(bad)


def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_recorder_flushes_in_the_background_and_on_close(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator")
    rec = RunRecorder(store, rid, flush_interval_s=0.1)
    rec.request({"request_id": "a", "status": "ok"})
    wait_until(lambda: len(store.requests(rid)) == 1)
    threads = [
        threading.Thread(
            target=lambda k=k: [rec.request({"request_id": f"{k}-{i}", "status": "ok"}) for i in range(500)]
        )
        for k in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.policy_event(t=1.0, kind="routing", old="a", new="b", params={}, source="tui")
    rec.policy_event(t=2.0, kind="routing", old="a", new="c", params={}, source="cli", pool="B")
    rec.close(status="completed", summary={"n": 1001})
    assert len(store.requests(rid)) == 1001
    assert [(e["source"], e["pool"]) for e in store.policy_events(rid)] == [("tui", None), ("cli", "B")]
    assert store.get_run(rid).status == "completed"


def test_run_of_a_killed_process_is_marked_interrupted(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    code = (
        "import sys, time\n"
        "from adapters.store import RunStore\n"
        f"s = RunStore({str(db)!r}); print(s.create_run(kind='live', backend='emulator'), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        rid = proc.stdout.readline().strip()
        store = RunStore(db)
        assert store.mark_interrupted_runs() == []  # still alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert store.mark_interrupted_runs() == [rid]
        assert store.get_run(rid).status == "interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_record_sqlite_cannot_hold_costs_only_itself_and_the_recorder_keeps_going(tmp_path: Path) -> None:
    """An integer beyond 64 bits is stored as NULL (the row is kept); a value SQLite cannot bind
    at all loses that one record, not its batch, and the recorder thread stays alive."""
    store = RunStore(tmp_path / "runs.db")
    rid = store.create_run(kind="live", backend="emulator", cluster="1P1D")
    rec = RunRecorder(store, rid, flush_interval_s=0.05)
    rec.request({"request_id": "huge", "max_tokens": 2**70, "status": "failed", "reason": "bad max_tokens"})
    rec.request({"request_id": "unbindable", "max_tokens": 5, "status": "ok", "reason": {"not": "a string"}})
    rec.request({"request_id": "fine", "max_tokens": 7, "status": "ok"})
    rec.flush()
    rec.request({"request_id": "later", "max_tokens": 9, "status": "ok"})
    rec.close("completed")
    rows = {r["request_id"]: r for r in store.requests(rid)}
    assert set(rows) == {"huge", "fine", "later"}
    assert (
        rows["huge"]["max_tokens"] is None
        and rows["huge"]["reason"] == "bad max_tokens"
        and rows["fine"]["max_tokens"] == 7
    )


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
