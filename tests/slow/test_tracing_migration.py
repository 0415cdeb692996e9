"""A traced request migrated between emulated decode instances mid-stream: the migration span, the source's leg
handed over, the target's leg and its engine span under it (tests/e2e/test_tracing_e2e.py has the plain request)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import otlp_receiver
from tests.procs import FIXED_PROFILE, kill_children, start_console, wait_for

pytestmark = pytest.mark.slow  # a console decoding a 1,000-token stream while it moves: ~12 s

TOKENS = 1000
"""About 3 s of decoding on FIXED_PROFILE: time to move it mid-stream."""


def test_a_migrated_request_s_trace_follows_it(
    tmp_path: Path, sibyl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with otlp_receiver() as rx:
        con = start_console(
            tmp_path, "--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "2", "--otlp-endpoint", rx.url
        )
        try:
            rid = uuid.uuid4().hex
            got: dict[str, Any] = {}

            def stream() -> None:
                body = {"prompt": "move me", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
                r = httpx.post(f"{con.url}/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
                got["status"], got["text"] = r.status_code, r.text

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
            t.join(60)
            assert got["status"] == 200 and "[DONE]" in got["text"]
            (root,) = rx.wait(
                lambda s: s["name"] == "sibyl.request" and s["attributes"]["sibyl.request.id"] == rid, 1, 20
            )
            trace = root["trace_id"]
            # the source's engine span and the target's: both legs reached an instance that traced them
            engine = rx.wait(lambda s: s["trace_id"] == trace and s["name"] == "llm_request", 3, timeout=20)
            spans = rx.find(lambda s: s["trace_id"] == trace)
            by_name: dict[str, list[dict[str, Any]]] = {}
            for s in spans:
                by_name.setdefault(s["name"], []).append(s)
            assert root["attributes"]["sibyl.decode_instance"] == target
            (migration,) = by_name["sibyl.migration"]
            assert migration["parent_id"] == root["span_id"]
            assert migration["attributes"]["sibyl.from"] == source and migration["attributes"]["sibyl.to"] == target
            assert migration["attributes"]["sibyl.streamed_tokens"] > 0 and migration["end"] >= migration["start"]
            legs = {s["attributes"]["sibyl.instance"]: s for s in by_name["sibyl.decode"]}
            assert set(legs) == {source, target}
            assert legs[source]["attributes"]["sibyl.handed_over_to"] == target
            assert legs[target]["attributes"]["sibyl.leg"] == "migration" and legs[target]["status"] != 2
            assert legs[source]["end"] <= migration["start"] + 1_000_000
            under = {s["parent_id"] for s in engine}
            assert {legs[source]["span_id"], legs[target]["span_id"]} <= under
            assert con.stop() == 0
        finally:
            con.stop()
            kill_children(con.home)
