"""Request spans (console/live/tracing.py) of LiveRequests run against real emulator processes, into an in-memory
exporter: the phases, their parent links, attributes, a client's traceparent kept, a retried prefill, a failover;
and that tracing off never imports opentelemetry."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from adapters.backends.emulator import emulator_args
from adapters.ports import free_port
from adapters.vllm.instances import Instance
from adapters.vllm.launcher import VllmInstanceSpec, build_command, build_env
from console.live.channel import ClientChannel
from console.live.config import ConsoleConfig, TracingSettings, load_config
from console.live.request import LiveRequest
from console.live.tracing import Tracing, build
from core.types import Request, Role
from tests.console.live.fakes import FakeParts, Sent, dispatcher, never_disconnects
from tests.procs import FAST_PROFILE, ROOT, emulators

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[Instance]]:
    """p0 refuses connections (nothing listens on its port); p1, d0 and d1 are emulator processes."""
    with emulators(
        ("prefill", ["--profile", FAST_PROFILE]),
        ("decode", ["--profile", FAST_PROFILE]),
        ("decode", ["--profile", FAST_PROFILE]),
    ) as (p1, d0, d1):
        yield [
            Instance("p0", Role.PREFILL, f"http://127.0.0.1:{free_port()}"),
            Instance("p1", Role.PREFILL, p1.url),
            Instance("d0", Role.DECODE, d0.url),
            Instance("d1", Role.DECODE, d1.url),
        ]


def serve(
    insts: list[Instance], headers: dict[bytes, str], max_tokens: int = 8, **host_kw: Any
) -> tuple[LiveRequest, list[ReadableSpan], Sent]:
    """Run one streamed request through fake parts over `insts` with tracing into memory."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingSettings(endpoint="http://127.0.0.1:4318"), exporter)

    async def body() -> tuple[LiveRequest, Sent]:
        host = FakeParts(insts, dispatcher(insts, **host_kw))
        for inst in insts:
            inst.open(connect_timeout_s=2.0)
        try:
            body = {"prompt": "hello there", "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
            req = Request("r1", time.monotonic(), 3, max_tokens)
            live = LiveRequest(req, "/v1/completions", body, b"X-Request-Id: r1\r\n")
            live.trace = tracing.start(headers, "r1", live.request.arrival)
            sent = Sent()
            await live.run(host.services, ClientChannel(sent, never_disconnects))
            return live, sent
        finally:
            for inst in insts:
                await inst.close()

    live, sent = asyncio.run(body())
    tracing.shutdown()
    return live, list(exporter.get_finished_spans()), sent


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


def test_a_request_s_phases_are_children_of_the_client_s_trace(cluster: list[Instance]) -> None:
    live, spans, sent = serve(cluster, {b"traceparent": TRACEPARENT})
    assert live.record.ok and sent.status == 200
    (root,) = by_name(spans, "sibyl.request")
    ctx = root.context
    assert ctx is not None and root.parent is not None
    assert f"{ctx.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT_ID
    assert root.kind == SpanKind.SERVER and root.status.status_code != StatusCode.ERROR
    attrs = dict(root.attributes or {})
    assert attrs["sibyl.request.id"] == "r1" and attrs["sibyl.outcome"] == "finished"
    assert attrs["sibyl.policy.routing"] == "round_robin" and attrs["sibyl.policy.queue"] == "fcfs"
    assert attrs["sibyl.prefill_instance"] == "p1" and attrs["sibyl.decode_instance"] == "d0"
    assert attrs["sibyl.output_tokens"] == 8 and attrs["sibyl.failed_prefill"] == ("p0",)
    children = [s for s in spans if s is not root]
    assert all(s.parent is not None and s.parent.span_id == ctx.span_id for s in children)
    assert all(s.context is not None and s.context.trace_id == ctx.trace_id for s in children)
    assert {s.name for s in children} == {"sibyl.route", "sibyl.prefill", "sibyl.kv_handoff", "sibyl.decode"}
    (route,) = by_name(spans, "sibyl.route")
    assert dict(route.attributes or {}) == {
        "sibyl.policy.routing": "round_robin",
        "sibyl.stage": "arrival",
        "sibyl.prefill_instance": "p0",
        "sibyl.decode_instance": "d0",
    }
    failed, prefill = by_name(spans, "sibyl.prefill")  # p0 refused: sent once more, to p1
    assert failed.status.status_code == StatusCode.ERROR and "p0 unreachable" in (failed.status.description or "")
    assert (failed.attributes or {})["sibyl.instance"] == "p0" and (prefill.attributes or {})["sibyl.instance"] == "p1"
    assert prefill.kind == SpanKind.CLIENT and prefill.status.status_code != StatusCode.ERROR
    (handoff,) = by_name(spans, "sibyl.kv_handoff")
    (decode,) = by_name(spans, "sibyl.decode")
    assert dict(handoff.attributes or {}) == {"sibyl.from": "p1", "sibyl.to": "d0"}
    assert (decode.attributes or {})["sibyl.instance"] == "d0" and decode.kind == SpanKind.CLIENT
    # the phases in time: prefill, then the hand-off from its end to the first token, inside the decode leg
    assert prefill.end_time is not None and handoff.start_time is not None and handoff.end_time is not None
    assert decode.start_time is not None and decode.end_time is not None and root.end_time is not None
    assert handoff.start_time >= prefill.end_time - 1000 and decode.start_time >= prefill.end_time
    assert decode.start_time <= handoff.end_time <= decode.end_time <= root.end_time


def test_a_queued_request_has_its_wait_and_a_new_trace_without_traceparent(cluster: list[Instance]) -> None:
    class Releasing(FakeParts):
        def hold(self, request_id: str, released: asyncio.Future[None]) -> None:  # let go 50 ms later
            super().hold(request_id, released)
            asyncio.get_running_loop().call_later(0.05, released.set_result, None)

    insts = cluster[1:3]  # p1, d0
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingSettings(endpoint="http://127.0.0.1:4318"), exporter)

    async def body() -> LiveRequest:
        host = Releasing(insts, dispatcher(insts, queue=("fcfs", {"max_in_flight_per_instance": 1})))
        busy = Request("busy", 0.0, 3, 4)
        host.dispatcher.admit(busy, 0.0)
        host.dispatcher.route(busy, 0.0)
        for inst in insts:
            inst.open(connect_timeout_s=2.0)
        try:
            now = time.monotonic()
            live = LiveRequest(Request("r2", now, 3, 4), "/v1/completions", {"prompt": "x", "max_tokens": 4}, b"")
            live.trace = tracing.start({}, "r2", now)
            await live.run(host.services, ClientChannel(Sent(), never_disconnects))
            return live
        finally:
            for inst in insts:
                await inst.close()

    live = asyncio.run(body())
    spans = list(exporter.get_finished_spans())
    assert live.record.ok
    (root,) = by_name(spans, "sibyl.request")
    assert root.parent is None  # no traceparent: the gateway starts the trace
    (queue,) = by_name(spans, "sibyl.queue")
    (route,) = by_name(spans, "sibyl.route")
    assert queue.end_time is not None and queue.start_time is not None
    assert 0.04e9 <= queue.end_time - queue.start_time < 5e9 and route.start_time == queue.end_time
    assert dict(queue.attributes or {}) == {"sibyl.policy.queue": "fcfs"}
    # a whole (not streamed) reply has no first token: no hand-off span, the decode leg spans it
    assert by_name(spans, "sibyl.kv_handoff") == [] and len(by_name(spans, "sibyl.decode")) == 1


def test_a_failover_has_its_span_and_the_continuation_its_own_leg(cluster: list[Instance]) -> None:
    d0 = cluster[2]
    httpx.put(f"{d0.url}/admin/faults", json={"exit_after_tokens": 5}, timeout=5).raise_for_status()
    live, spans, _ = serve([cluster[1], d0, cluster[3]], {b"traceparent": TRACEPARENT}, max_tokens=40)
    rec = live.record
    assert rec.ok and rec.tried_decode == ["d0"] and rec.decode_instance == "d1"
    assert rec.reason is not None and "resumed on d1" in rec.reason  # the recovery, recorded as the reason
    (root,) = by_name(spans, "sibyl.request")
    assert (root.attributes or {})["sibyl.failed_decode"] == ("d0",)
    first, continued = by_name(spans, "sibyl.decode")
    assert (first.attributes or {})["sibyl.instance"] == "d0" and first.status.status_code == StatusCode.ERROR
    assert (continued.attributes or {})["sibyl.instance"] == "d1"
    assert (continued.attributes or {})["sibyl.leg"] == "continuation"
    (failover,) = by_name(spans, "sibyl.failover")
    attrs = dict(failover.attributes or {})
    assert attrs["sibyl.from"] == "d0" and attrs["sibyl.to"] == "d1" and attrs["sibyl.streamed_tokens"] >= 1
    assert failover.end_time is not None and continued.start_time is not None
    assert failover.end_time <= continued.start_time + 1000
    (handoff,) = by_name(spans, "sibyl.kv_handoff")
    assert dict(handoff.attributes or {}) == {"sibyl.from": "p1"}  # its decode side was d0, which then failed


def test_tracing_off_never_imports_opentelemetry() -> None:
    assert build(ConsoleConfig().tracing) is None
    code = (
        "import sys, console.cli, console.gateway.app, console.serve, console.live.tracing\n"
        "import adapters.emulator.app, adapters.backends.vllm\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_endpoint_turns_tracing_on_and_reaches_the_instances() -> None:
    cfg = load_config(None, {"tracing.endpoint": "http://127.0.0.1:4318", "backend": "vllm"})
    assert cfg.tracing.enabled and cfg.vllm.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert emulator_args(cfg.backend_settings())[-4:] == [
        "--otlp-traces-endpoint",
        "http://127.0.0.1:4318/v1/traces",
        "--otlp-traces-protocol",
        "http/protobuf",
    ]
    spec = VllmInstanceSpec(role=Role.DECODE, port=8200, model="/m", otlp_traces_endpoint=cfg.vllm.otlp_traces_endpoint)
    cmd = build_command(spec)
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4318/v1/traces"
    env = build_env(spec)
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf" and env["OTEL_SERVICE_NAME"] == "decode-8200"
    off = load_config(None, {"tracing.endpoint": "http://127.0.0.1:4318", "tracing.instances": False})
    assert off.tracing.enabled and off.emulator.otlp_traces_endpoint is None
    assert "--otlp-traces-endpoint" not in build_command(VllmInstanceSpec(role=Role.DECODE, port=8200, model="/m"))
    with pytest.raises(Exception, match="without an endpoint"):
        load_config(None, {"tracing.enabled": True})


def test_the_sample_ratio_drops_new_traces_but_a_client_s_sampled_trace_is_kept() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingSettings(endpoint="http://127.0.0.1:4318", sample_ratio=0.0), exporter)
    now = time.monotonic()
    dropped = tracing.start({}, "r1", now)
    lines = dropped.prefill_leg("p0", b"X-Request-Id: r1\r\n", now)
    dropped.prefill_done()
    dropped.root.end()
    assert exporter.get_finished_spans() == ()
    # the leg still says so: an engine that traces drops it too (its sampler follows the parent)
    assert lines.startswith(b"X-Request-Id: r1\r\ntraceparent: 00-")
    assert int(lines.strip().rsplit(b"-", 1)[1], 16) & 1 == 0  # the W3C sampled flag is off
    kept = tracing.start({b"traceparent": TRACEPARENT, b"tracestate": "vendor=x"}, "r2", now)
    lines = kept.prefill_leg("p0", b"", now)
    kept.prefill_done()
    kept.root.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["sibyl.prefill", "sibyl.request"]
    assert lines.startswith(f"traceparent: 00-{TRACE_ID}-".encode()) and b"tracestate: vendor=x\r\n" in lines
    tracing.shutdown()
