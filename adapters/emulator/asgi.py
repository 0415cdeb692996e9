"""Raw-ASGI plumbing of the emulator: bodies, answers, and the token writers of SSE responses.

Streaming is the hot path (500 streams × one token per step). The engine formats each stream's
next event before a step's deadline and writes them all when it passes. Under uvicorn the write
goes straight to the connection's transport as an HTTP chunk (`DirectSink`: one syscall, no task
switch); uvicorn's `send` is still used for the response start and the final chunk, so its
keep-alive and completion bookkeeping stay intact. Under any other ASGI server (or an HTTP/1.0
client) the events go through a queue drained by the request's task (`QueueSink`).
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adapters.emulator.protocol import Formatter

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON: Headers = [(b"content-type", b"application/json")]
SSE: Headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(parts)
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def respond_with_length(send: Send, status: int, body: bytes, headers: Headers = JSON) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [*headers, (b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


def direct_transport(send: Send) -> asyncio.WriteTransport | None:
    """The connection behind uvicorn's `send` if it streams chunked (after the response start)."""
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    return transport


class DirectSink:
    """Writes each token event as an HTTP/1.1 chunk to the connection at the step deadline."""

    __slots__ = ("fmt", "transport", "timing", "pending", "fd", "raw")

    def __init__(self, fmt: Formatter, transport: asyncio.WriteTransport, timing: bool) -> None:
        self.fmt, self.transport, self.timing = fmt, transport, timing
        self.pending = b""
        sock = transport.get_extra_info("socket")
        self.fd: int = sock.fileno() if sock is not None else -1
        self.raw = False
        """May the next write bypass the transport (nothing queued in it, so order is kept)?"""

    def prepare(self, index: int, finish_reason: str | None, step: int, deadline: float) -> None:
        event = self.fmt.chunk(index, finish_reason, (step, deadline) if self.timing else None)
        self.pending = b"%x\r\n%b\r\n" % (len(event), event)
        self.raw = self.fd >= 0 and self.transport.get_write_buffer_size() == 0

    def release(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.pending)

    def close(self) -> None:
        pass


def _write_raw(share: list[tuple[int, bytes, DirectSink]]) -> list[DirectSink]:
    """os.write each chunk (the GIL is released meanwhile); return the sinks not fully sent."""
    left = []
    write = os.write
    for fd, data, sink in share:
        try:
            n = write(fd, data)
        except BlockingIOError:
            left.append(sink)
            continue
        except OSError:
            continue  # the peer is gone; the disconnect watcher aborts the sequence
        if n < len(data):
            sink.pending = data[n:]
            left.append(sink)
    return left


class Flusher:
    """Writes one step's tokens at its deadline, splitting large batches over threads.

    Each write is a socket send whose kernel work (loopback TCP included) costs ~10-15 µs on a
    small VM, so 500 streams take 5-8 ms from one thread. With `threads` > 1, batches of at least
    `min_batch` are split: this thread and the pool's threads write their shares with os.write
    (which releases the GIL) while the event loop waits, so no callback can close (and no new
    connection can reuse) one of those sockets meanwhile; a closing transport is skipped, and
    whatever a non-blocking write could not take goes through the transport afterwards.
    """

    def __init__(self, threads: int = 2, min_batch: int = 64) -> None:
        self.threads = max(1, threads)
        self.min_batch = min_batch
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="emulator-writer") if self.threads > 1 else None
        )

    def __call__(self, sinks: list[Any]) -> None:
        if len(sinks) < self.min_batch:
            for s in sinks:
                s.release()
            return
        collecting = gc.isenabled()
        gc.disable()  # a collection in the middle of 500 writes would delay the tail by milliseconds
        try:
            self._flush(sinks)
        finally:
            if collecting:
                gc.enable()

    def _flush(self, sinks: list[Any]) -> None:
        raw: list[tuple[int, bytes, DirectSink]] = []
        for s in sinks:
            if type(s) is DirectSink and s.raw:
                if not s.transport.is_closing():
                    raw.append((s.fd, s.pending, s))
            else:
                s.release()
        k = self.threads
        futures = [self._pool.submit(_write_raw, raw[i::k]) for i in range(1, k)] if self._pool is not None else []
        left = _write_raw(raw[0::k])
        for f in futures:
            left += f.result()
        for s in left:
            s.release()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class QueueSink:
    """Hands token events to the request's task, which sends them through ASGI."""

    __slots__ = ("fmt", "timing", "pending", "queue")

    def __init__(self, fmt: Formatter, timing: bool) -> None:
        self.fmt, self.timing = fmt, timing
        self.pending = b""
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def prepare(self, index: int, finish_reason: str | None, step: int, deadline: float) -> None:
        self.pending = self.fmt.chunk(index, finish_reason, (step, deadline) if self.timing else None)

    def release(self) -> None:
        self.queue.put_nowait(self.pending)

    def close(self) -> None:
        self.queue.put_nowait(None)


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Future[Any]:
    """Call `on_disconnect` if the client goes away; cancel the returned future when done."""
    fut = asyncio.ensure_future(receive())

    def done(f: asyncio.Future[Any]) -> None:
        if not f.cancelled() and f.exception() is None and f.result().get("type") == "http.disconnect":
            on_disconnect()

    fut.add_done_callback(done)
    return fut
