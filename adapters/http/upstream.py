"""A lean HTTP/1.1 client for the gateway's hot path: pooled keep-alive connections to one upstream.

The gateway's two P/D legs are plain POSTs to a vLLM server on a known address, streamed back
chunk by chunk. aiohttp's ClientSession spends CPU on generality this path never uses (cookies,
redirects, tracing, proxies, per-request timeouts, header case-folding); this client parses
responses with httptools (the parser uvicorn uses): about 155 µs of CPU per streamed request
against aiohttp's 240, measured once in one process against the same fake upstream (no script
in the repository repeats that comparison; benchmarks/gateway_bench.py measures the whole
gateway, README there). It does exactly what the legs need: write one request, read status and
body — whole or as chunks as they arrive — and put the connection back for the next request when
the response said keep-alive. Anything else (health probes, /metrics, /v1/models) uses aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

IDLE_TTL_S = 4.0
"""Pooled connections idle longer than this are closed, not reused: uvicorn (vLLM's server) closes
idle keep-alive connections after 5 s, and a request written into that close is lost."""
READ_HIGH_WATER = 1 << 20
"""Bytes buffered from the upstream before reading pauses until the consumer catches up."""


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the response was complete."""


class _Connection(asyncio.Protocol):
    """One TCP connection; carries one request/response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.received = False
        self._wake: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.paused = False

    # --- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamClosed(f"malformed HTTP response: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(UpstreamClosed(f"connection closed before the response was complete{f': {exc}' if exc else ''}"))

    # --- httptools callbacks ----------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        w = self._wake  # `_notify()`, inlined: this runs once per piece of body (a streamed event, often)
        if w is not None and not w.done():
            w.set_result(None)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()
        self._notify()

    # --- consumer side ----------------------------------------------------------------------------
    def _notify(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved: a leg that never awaits it must not warn
        self._notify()

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body (several arrivals joined), or None when the body is complete."""
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
            self._wake = None
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A response being received; `release()` (or `async with`) hands the connection back."""

    __slots__ = ("_conn", "_pool", "status")

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (whatever arrived since the last chunk, joined)."""
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    def release(self) -> None:
        """Back to the pool when the response was read to its end and may be kept alive; else closed."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is not None:
            self._pool._give_back(conn)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class UpstreamPool:
    """Keep-alive connections to one upstream (http or https URL, with an optional path prefix),
    reused most-recent first."""

    def __init__(self, url: str, connect_timeout_s: float = 30.0, max_idle: int = 256) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/").encode()
        self.tls: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()
        self._host_header = (parts.netloc.rpartition("@")[2]).encode()
        self.closed = False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(_Connection, self.host, self.port, ssl=self.tls)
        _, conn = await asyncio.wait_for(connecting, self.connect_timeout_s)
        return conn

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TTL_S:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Connection) -> None:
        if (
            self.closed
            or conn.closed
            or not conn.complete
            or conn.error is not None
            or len(self._idle) >= self.max_idle
        ):
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn._reset()
        self._idle.append(conn)

    async def post(self, path: str, body: bytes, headers: bytes = b"") -> Response:
        """POST `body` (JSON) to `path`; `headers` are extra `Name: value\\r\\n` lines. Returns once
        the status line and headers arrived; the body is read from the Response."""
        head = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
            self.prefix,
            path.encode(),
            self._host_header,
            len(body),
            headers,
        )
        conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        while True:
            assert conn.transport is not None
            conn.transport.write(head + body)
            try:
                await conn.headers_done
            except UpstreamClosed:
                conn.close()
                if reused and not conn.received:  # a pooled connection closed under us: nothing was read
                    conn, reused = await self._connect(), False
                    continue
                raise
            except asyncio.CancelledError:
                conn.close()  # the caller gave up before the answer: the connection cannot be reused
                raise
            return Response(conn, self)

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()
