"""A console process with `--otlp-endpoint` exports its request spans over OTLP/HTTP to a receiver the test runs;
the emulated instances it started join the same trace under the legs (the traceparent reached them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import otlp_receiver
from tests.procs import FAST_PROFILE, kill_children, start_console

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def test_the_gateway_s_trace_reaches_the_instances(
    tmp_path: Path, sibyl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the processes export every 100 ms (OTel's default: 5 s)
    with otlp_receiver() as rx:
        con = start_console(
            tmp_path,
            "--profile",
            FAST_PROFILE,
            "--prefill",
            "1",
            "--decode",
            "1",
            "--policy",
            "round_robin",
            "--otlp-endpoint",
            rx.url.removesuffix("/v1/traces"),  # a bare http://host:port gets OTLP's /v1/traces
        )
        try:
            body = {"prompt": "tell me", "max_tokens": 6, "ignore_eos": True, "stream": True}
            sent = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "traced-1"}
            r = httpx.post(f"{con.url}/v1/completions", json=body, headers=sent, timeout=30)
            assert r.status_code == 200 and "[DONE]" in r.text
            r = httpx.post(f"{con.url}/v1/completions", json={**body, "stream": False}, timeout=30)
            assert r.status_code == 200

            def in_trace(s: dict[str, Any]) -> bool:
                return bool(s["trace_id"] == TRACE_ID)

            spans = rx.wait(in_trace, 7, timeout=20)  # root, route, prefill, kv_handoff, decode + two llm_request
            by_name: dict[str, list[dict[str, Any]]] = {}
            for s in spans:
                by_name.setdefault(s["name"], []).append(s)
            (root,) = by_name["sibyl.request"]
            assert root["parent_id"] == PARENT_ID and root["service"] == "sibyl-console" and root["kind"] == "server"
            assert root["attributes"]["sibyl.request.id"] == "traced-1"
            assert root["attributes"]["sibyl.outcome"] == "finished"
            assert root["attributes"]["sibyl.policy.routing"] == "round_robin"
            assert root["attributes"]["sibyl.output_tokens"] == 6
            assert {"sibyl.route", "sibyl.prefill", "sibyl.kv_handoff", "sibyl.decode"} <= set(by_name)
            for name in ("sibyl.route", "sibyl.prefill", "sibyl.kv_handoff", "sibyl.decode"):
                assert all(s["parent_id"] == root["span_id"] for s in by_name[name]), name
            (prefill,) = by_name["sibyl.prefill"]
            (decode,) = by_name["sibyl.decode"]
            assert prefill["kind"] == decode["kind"] == "client"
            # each instance's own span hangs under the leg that reached it
            engine = {s["parent_id"]: s for s in by_name["llm_request"]}
            assert set(engine) == {prefill["span_id"], decode["span_id"]}
            on_p, on_d = engine[prefill["span_id"]], engine[decode["span_id"]]
            assert on_p["service"].startswith("prefill-") and on_d["service"].startswith("decode-")
            assert on_p["kind"] == on_d["kind"] == "server"
            assert on_d["attributes"]["gen_ai.request.id"] == "cmpl-traced-1"
            assert on_d["attributes"]["gen_ai.usage.completion_tokens"] == 6
            assert prefill["start"] <= on_p["start"] and on_p["end"] <= prefill["end"]
            # the request without a traceparent starts its own trace, which the instances join too
            (other,) = rx.wait(lambda s: s["name"] == "sibyl.request" and s["trace_id"] != TRACE_ID, 1, timeout=20)
            assert other["parent_id"] == ""
            rx.wait(lambda s: s["name"] == "llm_request" and s["trace_id"] == other["trace_id"], 2, timeout=20)
            assert con.stop() == 0
        finally:
            con.stop()
            kill_children(con.home)
