"""OpenTelemetry plumbing shared by the console and the emulator: the OTLP exporter, W3C headers, clock conversion.

Everything here imports opentelemetry (the optional `tracing` extra) inside the function that needs it, so a
process with tracing off never loads it (`tracer_provider` is only called when tracing is on).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from adapters.errors import AdapterError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

Protocol = Literal["http/protobuf", "grpc"]
TRACE_HEADERS = (b"traceparent", b"tracestate")
"""The W3C trace-context headers (what vLLM's API server reads from a request, vllm/tracing/utils.py)."""
INSTALL_HINT = "pip install 'sibyl-console[tracing]'"


class TracingUnavailable(AdapterError):
    """Tracing was asked for but the opentelemetry packages it needs are not installed."""


def traces_url(endpoint: str, protocol: Protocol) -> str:
    """The URL an exporter is given: OTLP/HTTP's `/v1/traces` is added to a bare `http://host:port`
    (vLLM and the OTLP HTTP exporter use an explicit endpoint as is); a gRPC endpoint is left alone."""
    if protocol == "http/protobuf":
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"OTLP/HTTP endpoint {endpoint!r}: expected http(s)://host:port[/v1/traces]")
        if parts.path in ("", "/"):
            return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def missing(protocol: Protocol) -> str | None:
    """What to install for tracing over `protocol` when a package it needs is absent (None: all there)."""
    exporter = "grpc" if protocol == "grpc" else "http"
    for module in ("opentelemetry.sdk", f"opentelemetry.exporter.otlp.proto.{exporter}"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is absent
            found = False
        if not found:
            return "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else INSTALL_HINT
    return None


def span_exporter(endpoint: str, protocol: Protocol) -> SpanExporter:
    """An OTLP exporter to `endpoint` (OTLP/HTTP with protobuf, or gRPC without TLS as vLLM's own)."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=endpoint, insecure=True)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    except ImportError as e:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else INSTALL_HINT
        raise TracingUnavailable(f"tracing over {protocol} needs {extra} ({e})") from None
    return Http(endpoint=traces_url(endpoint, "http/protobuf"))


def tracer_provider(
    service_name: str,
    exporter: SpanExporter,
    *,
    sample_ratio: float = 1.0,
    batch: bool = True,
    attributes: Mapping[str, str] | None = None,
) -> TracerProvider:
    """A provider exporting through `exporter` (in a background thread when `batch`), sampling new traces at
    `sample_ratio` and following the sampled flag of an incoming parent."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise TracingUnavailable(f"tracing needs the opentelemetry SDK: {INSTALL_HINT} ({e})") from None
    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def incoming_context(headers: Mapping[bytes, bytes | str]) -> Context | None:
    """The parent context of a request's W3C `traceparent`/`tracestate` headers; None without a valid one."""
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if value:
            carrier[name.decode()] = value.decode("latin-1") if isinstance(value, bytes) else value
    if "traceparent" not in carrier:
        return None
    ctx = TraceContextTextMapPropagator().extract(carrier)
    return ctx if get_current_span(ctx).get_span_context().is_valid else None


def clock_offset_ns() -> int:
    """Add to `time.monotonic_ns()` for the wall clock OpenTelemetry stamps spans with (nanoseconds since the epoch)."""
    return time.time_ns() - time.monotonic_ns()
