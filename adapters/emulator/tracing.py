"""vLLM's request span for the emulator: with --otlp-traces-endpoint each request ends with an `llm_request` span.

vLLM 0.32 with --otlp-traces-endpoint reads a request's W3C `traceparent`/`tracestate` and, when the request
finishes, emits one SERVER span `llm_request` from its arrival, a child of that context (a new trace without
one), with `gen_ai.*` attributes (vllm/tracing/utils.py, vllm/v1/engine/output_processor.py). The emulator does
the same from its own engine's timestamps, so a console's trace shows each leg's engine side whatever the backend.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from adapters.tracing import Protocol, clock_offset_ns, incoming_context, span_exporter, tracer_provider

if TYPE_CHECKING:
    from adapters.emulator.sequence import Sequence

SPAN_NAME = "llm_request"


class EngineTracing:
    """The instance's tracer (its spans are exported in a background thread, flushed by `shutdown`)."""

    def __init__(self, endpoint: str, protocol: Protocol, *, model: str, service_name: str) -> None:
        from opentelemetry.trace import SpanKind  # the `tracing` extra: loaded only with --otlp-traces-endpoint

        self.provider = tracer_provider(service_name, span_exporter(endpoint, protocol))
        self.tracer = self.provider.get_tracer("vllm.llm_engine")
        self.model = model
        self.kind = SpanKind.SERVER

    def finished(self, headers: Mapping[bytes, bytes], request_id: str, seq: Sequence) -> None:
        """One `llm_request` span for `seq` (its times are the engine clock's, time.monotonic)."""
        offset = clock_offset_ns()
        arrival = seq.arrival
        end = seq.finished_at or time.monotonic()
        attributes: dict[str, str | int | float] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": self.model,
            "gen_ai.request.max_tokens": seq.max_tokens_param,
            "gen_ai.usage.prompt_tokens": seq.prompt_tokens,
            "gen_ai.usage.completion_tokens": seq.generated,
            "gen_ai.usage.cached_tokens": seq.cached_tokens,
            "gen_ai.latency.e2e": end - arrival,
        }
        if seq.admitted_at is not None:
            attributes["gen_ai.latency.time_in_queue"] = seq.admitted_at - arrival
        if seq.first_token_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = seq.first_token_at - arrival
        if seq.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = seq.finish_reason
        span = self.tracer.start_span(
            SPAN_NAME,
            context=incoming_context(headers),
            kind=self.kind,
            attributes=attributes,
            start_time=int(arrival * 1e9) + offset,
        )
        span.end(end_time=int(end * 1e9) + offset)

    def shutdown(self) -> None:
        """Export what is left (the process is stopping)."""
        self.provider.shutdown()
