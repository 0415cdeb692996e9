"""A tiny OTLP/HTTP trace receiver for tests: POST /v1/traces (protobuf) on 127.0.0.1, spans kept as plain dicts."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


@dataclass
class Receiver:
    url: str
    spans: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, raw: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(raw)
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        {
                            "service": resource.get("service.name"),
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex(),
                            "kind": KINDS.get(s.kind, str(s.kind)),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "status": s.status.code,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                        }
                    )
        with self.lock:
            self.spans.extend(got)

    def find(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if pred(s)]

    def wait(self, pred: Callable[[dict[str, Any]], bool], n: int, timeout: float) -> list[dict[str, Any]]:
        """At least `n` received spans matching `pred` (polls; raises AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(pred)
            if len(found) >= n:
                return found
            if time.monotonic() > deadline:
                with self.lock:
                    seen = sorted({(s["service"], s["name"]) for s in self.spans})
                raise AssertionError(f"{len(found)} of {n} spans after {timeout:.0f} s; received: {seen}")
            time.sleep(0.05)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """Serve OTLP/HTTP on a free port of 127.0.0.1 until the block ends (its url ends with /v1/traces)."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            holder[0].add(raw)
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(f"http://127.0.0.1:{server.server_address[1]}/v1/traces"))
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
