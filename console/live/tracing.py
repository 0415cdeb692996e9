"""OpenTelemetry spans of a live request's phases when [tracing] is on; off, opentelemetry is never imported.

One root span `sibyl.request` (SERVER; a child of the client's W3C `traceparent` when it sent one) per request,
and its children:

    sibyl.queue       held by the queue policy, from admission to release (queued requests only)
    sibyl.route       the routing decision (the policies, the pair chosen); again at prefill end for a late binding
    sibyl.prefill     each prefill leg (CLIENT; a failed attempt ends with status ERROR and the next is another span)
    sibyl.kv_handoff  prefill end to the first streamed token: the decode instance pulls the prompt's KV
    sibyl.decode      each decode leg (CLIENT): the first, one sent again, a failover's continuation, a migration's
    sibyl.failover    the decode instance failed under the request, until the continuation elsewhere was sent
    sibyl.migration   the source's hand-off event until the first token from the target

Every leg carries a `traceparent` naming its own span, so an engine that traces (vLLM with
--otlp-traces-endpoint, the emulator with the same flag) adds its `llm_request` span under the leg.
A LiveRequest holds its RequestSpans in `trace`; with tracing off it holds NO_TRACE, whose hooks do nothing (no
allocation, and opentelemetry is never imported).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from adapters.tracing import clock_offset_ns, incoming_context, span_exporter, tracer_provider
from console.live.config import TracingSettings
from console.live.record import Step

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from console.live.record import RequestRecord
    from core.dispatch import Dispatcher


class Tracing:
    """The console's tracer: spans are exported by a background thread (or by `exporter` directly, in tests)."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        # the optional `tracing` extra: imported only when tracing is on
        from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            assert settings.endpoint is not None  # TracingSettings refuses tracing on without one
            exporter = span_exporter(settings.endpoint, settings.protocol)
            batch = True
        else:
            batch = False
        self.provider = tracer_provider(
            settings.service_name, exporter, sample_ratio=settings.sample_ratio, batch=batch
        )
        self.tracer = self.provider.get_tracer("sibyl-console")
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = set_span_in_context
        self.SERVER, self.CLIENT, self.INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
        self.ERROR = StatusCode.ERROR

    def start(self, headers: Mapping[bytes, str], request_id: str, arrival: float) -> RequestSpans:
        """The root span of a request that arrived at `arrival` (monotonic) with these HTTP headers."""
        return RequestSpans(self, incoming_context(headers), request_id, arrival)

    def header_lines(self, span: Span) -> bytes:
        """`traceparent` (and `tracestate`) header lines naming `span` as the parent."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.in_context(span))
        return "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1")

    def shutdown(self) -> None:
        """Export what is left and stop the export thread."""
        self.provider.shutdown()


def build(settings: TracingSettings) -> Tracing | None:
    """The console's Tracing, or None when [tracing] is off."""
    return Tracing(settings) if settings.enabled else None


class SpanHooks:
    """The hooks a LiveRequest calls as it enters each phase; these do nothing (tracing off: NO_TRACE)."""

    __slots__ = ()

    def routed(self, live: RequestRecord, d: Dispatcher, decided_at: float) -> None:
        """The queue wait (if any) and the routing decision taken at `decided_at` (monotonic), ending now."""

    def bound_late(self, decode_instance: str, started: float) -> None:
        """The decode instance was chosen at prefill end, from `started` until now (a policy that binds late)."""

    def prefill_leg(self, instance_id: str, headers: bytes, start: float) -> bytes:
        """A prefill leg to `instance_id` starts: `headers`, plus its traceparent when traced."""
        return headers

    def prefill_done(self, error: BaseException | None = None) -> None:
        """The prefill leg answered, or failed with `error`."""

    def decode_leg(self, instance_id: str, headers: bytes, kind: str = "decode") -> bytes:
        """A decode leg to `instance_id` is sent: `headers`, plus its traceparent when traced."""
        return headers

    def decode_failed(self, instance_id: str, error: BaseException) -> None:
        """The decode leg on `instance_id` failed."""

    def failed_over(self, failed: str, target: str, streamed: int, why: str) -> None:
        """`failed` died under the request, which continues on `target`."""

    def handed_over(self, source: str, target: str, tokens: int) -> None:
        """The source's stream ended with its migration hand-off event."""

    def migrated(self, first_after: float) -> None:
        """The first token from the migration's target arrived."""

    def finish(self, live: RequestRecord) -> None:
        """The request left with its outcome."""


NO_TRACE = SpanHooks()
"""The hooks of every request while tracing is off."""


class RequestSpans(SpanHooks):
    """One request's spans (see the module docstring for each)."""

    __slots__ = (
        "t",
        "root",
        "ctx",
        "offset",
        "prefill",
        "prefill_end",
        "decodes",
        "failover",
        "migration",
        "legs",
        "moved",
    )

    def __init__(self, t: Tracing, parent: Any, request_id: str, arrival: float) -> None:
        self.t = t
        self.offset = clock_offset_ns()
        self.root = t.tracer.start_span(
            "sibyl.request",
            context=parent,
            kind=t.SERVER,
            start_time=self.ns(arrival),
            attributes={"sibyl.request.id": request_id},
        )
        self.ctx = t.in_context(self.root)
        self.prefill: Span | None = None
        self.prefill_end: float | None = None
        self.decodes: dict[str, Span] = {}
        """Open decode legs by instance (two while a migration's target stream is opened ahead of the hand-off)."""
        self.failover: Span | None = None
        self.migration: Span | None = None
        self.legs = 0
        self.moved = False
        """A failover or migration happened: the decode instance now is not the one the KV went to."""

    def ns(self, t: float) -> int:
        """A monotonic time as OpenTelemetry's wall-clock nanoseconds."""
        return int(t * 1e9) + self.offset

    def _child(self, name: str, start: float, attributes: dict[str, Any], kind: Any = None) -> Span:
        return self.t.tracer.start_span(
            name, context=self.ctx, kind=kind or self.t.INTERNAL, start_time=self.ns(start), attributes=attributes
        )

    def _end(self, span: Span, at: float | None = None, error: str | None = None) -> None:
        if error is not None:
            span.set_status(self.t.ERROR, error)
        span.end(end_time=self.ns(time.monotonic() if at is None else at))

    # --- admission and routing ------------------------------------------------------------------------
    def routed(self, live: RequestRecord, d: Dispatcher, decided_at: float) -> None:
        policies = {f"sibyl.policy.{k.value}": p.name for k, p in d.policies.items()}
        self.root.set_attributes(policies)
        queued = live.at(Step.QUEUED)
        if queued is not None:
            span = self._child("sibyl.queue", queued, {"sibyl.policy.queue": policies.get("sibyl.policy.queue", "")})
            self._end(span, decided_at)
        attrs: dict[str, Any] = {
            "sibyl.policy.routing": policies.get("sibyl.policy.routing", ""),
            "sibyl.stage": "arrival",
        }
        if live.prefill_instance is not None:
            attrs["sibyl.prefill_instance"] = live.prefill_instance
        if live.decode_instance is not None:
            attrs["sibyl.decode_instance"] = live.decode_instance
        else:
            attrs["sibyl.decode_binding"] = "late"
        self._end(self._child("sibyl.route", decided_at, attrs))

    def bound_late(self, decode_instance: str, started: float) -> None:
        attrs = {"sibyl.stage": "prefill end", "sibyl.decode_instance": decode_instance}
        self._end(self._child("sibyl.route", started, attrs))

    # --- legs -------------------------------------------------------------------------------------------
    def prefill_leg(self, instance_id: str, headers: bytes, start: float) -> bytes:
        self.legs += 1
        attrs = {"sibyl.instance": instance_id, "sibyl.leg": "prefill", "sibyl.leg.attempt": self.legs}
        self.prefill = self._child("sibyl.prefill", start, attrs, self.t.CLIENT)
        return headers + self.t.header_lines(self.prefill)

    def prefill_done(self, error: BaseException | None = None) -> None:
        span, self.prefill = self.prefill, None
        if span is None:
            return
        end = time.monotonic()
        if error is None:
            self.prefill_end = end
        self._end(span, end, None if error is None else str(error))

    def decode_leg(self, instance_id: str, headers: bytes, kind: str = "decode") -> bytes:
        """Its span (ending a failover in progress), and `headers` with its traceparent."""
        now = time.monotonic()
        old = self.decodes.pop(instance_id, None)
        if old is not None:  # sent again to the same instance (the prompt recomputed there)
            self._end(old, now, "superseded by another leg to the same instance")
        if self.failover is not None:
            self._end(self.failover, now)
            self.failover = None
            kind = "continuation"
        self.legs += 1
        attrs = {"sibyl.instance": instance_id, "sibyl.leg": kind, "sibyl.leg.attempt": self.legs}
        span = self.decodes[instance_id] = self._child("sibyl.decode", now, attrs, self.t.CLIENT)
        return headers + self.t.header_lines(span)

    def decode_failed(self, instance_id: str, error: BaseException | str) -> None:
        span = self.decodes.pop(instance_id, None)
        if span is not None:
            self._end(span, None, str(error))

    # --- failures and moves -------------------------------------------------------------------------
    def failed_over(self, failed: str, target: str, streamed: int, why: str) -> None:
        """The failover span ends when the continuation's leg is sent."""
        self.decode_failed(failed, why)
        self.moved = True
        attrs = {"sibyl.from": failed, "sibyl.to": target, "sibyl.streamed_tokens": streamed, "sibyl.reason": why}
        if self.failover is not None:
            self._end(self.failover, None, "the continuation could not be sent")
        self.failover = self._child("sibyl.failover", time.monotonic(), attrs)

    def handed_over(self, source: str, target: str, tokens: int) -> None:
        now = time.monotonic()
        self.moved = True
        span = self.decodes.pop(source, None)
        if span is not None:
            span.set_attribute("sibyl.handed_over_to", target)
            self._end(span, now)
        attrs = {"sibyl.from": source, "sibyl.to": target, "sibyl.streamed_tokens": tokens}
        self.migration = self._child("sibyl.migration", now, attrs)

    def migrated(self, first_after: float) -> None:
        if self.migration is not None:
            self._end(self.migration, first_after)
            self.migration = None

    # --- the outcome --------------------------------------------------------------------------------
    def finish(self, live: RequestRecord) -> None:
        """The KV hand-off span, the outcome on the root, every open span ended."""
        end = live.finish
        first = live.first_token_at
        if self.prefill_end is not None and first is not None and first >= self.prefill_end:
            ends = {"sibyl.from": live.prefill_instance or ""}
            if not self.moved and live.decode_instance is not None:
                ends["sibyl.to"] = live.decode_instance
            self._end(self._child("sibyl.kv_handoff", self.prefill_end, ends), first)
        error = None if live.ok else (live.reason or "failed")
        for span in (self.prefill, self.failover, self.migration, *self.decodes.values()):
            if span is not None:
                self._end(span, end, error)
        self.decodes.clear()
        r = live.request
        attrs: dict[str, Any] = {
            "sibyl.outcome": live.step.value,
            "sibyl.slo_class": r.slo_class,
            "sibyl.stream": live.stream,
            "sibyl.prompt_tokens": r.prompt_tokens,
            "sibyl.output_tokens": live.output_tokens,
        }
        optional: dict[str, Any] = {
            "sibyl.tenant": r.tenant,
            "sibyl.prefill_instance": live.prefill_instance,
            "sibyl.decode_instance": live.decode_instance,
            "sibyl.cached_tokens": live.cached_tokens,
            "sibyl.dp_rank": live.dp_rank,
            "sibyl.reason": live.reason,
        }
        attrs.update({k: v for k, v in optional.items() if v not in (None, "")})
        if live.tried_prefill:
            attrs["sibyl.failed_prefill"] = list(live.tried_prefill)
        if live.tried_decode:
            attrs["sibyl.failed_decode"] = list(live.tried_decode)
        self.root.set_attributes(attrs)
        self._end(self.root, end, error)
