"""Live migration through the console: a streaming request moves between emulated decode instances
mid-stream and the OpenAI client reads every token exactly once; refusals say why."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from openai import OpenAI

from adapters.store import RunStore
from tests.procs import FIXED_PROFILE, kill_children, start_console, wait_for

pytestmark = pytest.mark.slow  # three consoles decoding 1,000-token streams: ~27 s (make test-slow); the
# emulator's side of a move is in test_emulator_migration.py, a stream resumed after a failure in test_console_e2e.py

TOKENS = 1000
"""About 3 s of decoding on FIXED_PROFILE: time to move it mid-stream."""


def test_a_stream_follows_its_request_to_another_decode_instance_without_a_lost_or_repeated_token(
    tmp_path: Path,
) -> None:
    con = start_console(
        tmp_path, "--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "2", "--policy", "round_robin"
    )
    try:
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=60)
        rid = uuid.uuid4().hex
        got: dict[str, object] = {}

        def stream() -> None:
            s = client.completions.create(
                model="sibyl-model",
                prompt="move me",
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": rid},
                stream_options={"include_usage": True},
            )
            chunks = list(s)
            got["texts"] = [c.choices[0].text for c in chunks if c.choices]
            got["usage"] = chunks[-1].usage

        t = threading.Thread(target=stream)
        t.start()

        def decoding_on() -> str | None:
            busy = [i["id"] for i in con.state()["instances"] if i["role"] == "decode" and i["running"] > 0]
            return busy[0] if len(busy) == 1 else None

        wait_for(lambda: decoding_on() is not None, 10, "the request decoding")
        source = decoding_on()
        target = "d1" if source == "d0" else "d0"
        with con.control() as ctl:
            moved = ctl.post("/control/migrate", json={"request_id": rid, "target": target})
        assert moved.status_code == 200, moved.text
        report = moved.json()
        assert (
            (report["source"], report["target"]) == (source, target) and report["stages"] >= 1 and report["tokens"] > 0
        )
        t.join(60)
        assert got["texts"] == [f" t{k}" for k in range(TOKENS)]  # every token once, in order
        assert got["usage"] is not None and got["usage"].completion_tokens == TOKENS  # type: ignore[attr-defined]
        # moving it again now that it finished, or to a prefill instance, is refused with why
        late = con.cli("migrate", rid, source)
        assert late.returncode != 0 and "is not decoding" in late.stderr
        con.stop()
        store = RunStore(con.db)
        [row] = [r for r in store.requests(con.run_id) if r["request_id"] == rid]
        assert row["status"] == "ok" and row["decode_instance"] == target and row["output_tokens"] == TOKENS
        [event] = [e for e in store.instance_events(con.run_id) if e["event"] == "migrated"]
        assert (
            event["instance_id"] == source
            and f"{rid} → {target}" in event["detail"]
            and "decode steps" in event["detail"]
        )
        print(f"[migration] {event['detail']}")
    finally:
        con.stop()
        kill_children(con.home)


def test_migrating_a_non_streaming_request_or_onto_a_prefill_instance_is_refused(tmp_path: Path) -> None:
    con = start_console(tmp_path, "--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "1")
    try:
        unknown = con.cli("migrate", "nope", "d0")
        assert unknown.returncode != 0 and "'nope' is not decoding" in unknown.stderr
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=60)
        rid = uuid.uuid4().hex
        t = threading.Thread(
            target=lambda: client.completions.create(
                model="sibyl-model",
                prompt="whole",
                max_tokens=TOKENS,
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": rid},
            )
        )
        t.start()
        wait_for(
            lambda: any(i["running"] > 0 for i in con.state()["instances"] if i["role"] == "decode"),
            10,
            "the request decoding",
        )
        with con.control() as ctl:
            whole = ctl.post("/control/migrate", json={"request_id": rid, "target": "p0"})
            assert whole.status_code == 409 and "not streaming" in whole.json()["error"]["message"]
        t.join(60)
    finally:
        con.stop()
        kill_children(con.home)


def test_a_reschedule_policy_moves_streams_onto_an_added_instance_and_no_client_notices(tmp_path: Path) -> None:
    """Four long streams decode on d0; d1 joins empty; `current_load` (every 0.5 s) moves streams
    to d1 through the backend's migration, each recorded with its stall, and every client reads
    every token once."""
    con = start_console(
        tmp_path, "--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "1", "--policy", "round_robin"
    )
    try:
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=60)
        texts: dict[int, list[str]] = {}

        def stream(k: int) -> None:
            s = client.completions.create(
                model="sibyl-model",
                prompt=f"drift {k}",
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts[k] = [c.choices[0].text for c in s if c.choices]

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        wait_for(
            lambda: next(i for i in con.state()["instances"] if i["id"] == "d0")["running"] == 4,
            10,
            "four streams on d0",
        )
        assert con.cli("scale", "decode", "1").returncode == 0
        wait_for(lambda: any(i["id"] == "d1" and i["healthy"] for i in con.state()["instances"]), 30, "d1 to join")
        with con.control() as ctl:
            r = ctl.put(
                "/control/policies/reschedule",
                json={"name": "current_load", "params": {"period_s": 0.5, "cooldown_s": 60}},
            )
            assert r.status_code == 200, r.text
        for th in threads:
            th.join(60)
        assert texts == {k: [f" t{j}" for j in range(TOKENS)] for k in range(4)}
        con.stop()
        store = RunStore(con.db)
        moved = [e for e in store.instance_events(con.run_id) if e["event"] == "migrated"]
        assert moved and all(e["instance_id"] == "d0" and "→ d1" in e["detail"] for e in moved)
        rows = store.requests(con.run_id)
        assert all(r["status"] == "ok" for r in rows) and sum(r["decode_instance"] == "d1" for r in rows) == len(moved)
    finally:
        con.stop()
        kill_children(con.home)
