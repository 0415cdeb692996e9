"""The client's side of a live request: its ASGI channel, the rejection it may get, stream writers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from adapters.vllm.pd_protocol import add_streamed_usage
from console.error_bodies import error_body
from console.live.record import Outcome

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
NEVER = asyncio.Event()
"""The `gone` of a client nobody watches: never set."""


async def respond(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] = JSON_HEADERS,
) -> None:
    """A whole response in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Rejected(Exception):
    """The request leaves before reaching an instance (queue full, expired, no capacity, its tenant's limits)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, *, outcome: Outcome) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.outcome = outcome
        """Which of the refusals it is (recorded as the request's outcome)."""


class ClientChannel:
    """The gateway's side of the client connection: what a LiveRequest may send it."""

    __slots__ = ("_send", "_receive", "gone", "_watcher", "started", "_complete")

    def __init__(
        self, send: Callable[[dict[str, Any]], Awaitable[None]], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> None:
        self._send = send
        self._receive = receive
        self.gone = NEVER
        """Set when the client disconnects (watched only while streaming or queued: `watch` gives
        each watched request its own event; unwatched ones share one that is never set)."""
        self._watcher: asyncio.Task[None] | None = None
        self.started = False
        """Whether the response's status line was sent (after that only the stream can carry an error)."""
        self._complete = False  # the response's last message was sent

    async def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> None:
        self.started = True
        await respond(self._send, status, body, headers)
        self._complete = True

    async def error(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        headers = (
            JSON_HEADERS
            if retry_after_s is None
            else [*JSON_HEADERS, (b"retry-after", str(max(1, round(retry_after_s))).encode())]
        )
        await self.respond(status, error_body(status, message), headers)

    async def start_stream(self, request_id: str) -> None:
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", request_id.encode())],
            }
        )

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, last: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": last, "more_body": False})
        self._complete = True

    def watch(self) -> None:
        """Notice a disconnect from now on (the body is read, so the next message is the client leaving)."""
        if self._watcher is None:
            self.gone = asyncio.Event()
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def close(self) -> None:
        """Stop watching. Once the response is complete the server answers the watcher's pending
        receive with a disconnect, so it ends by itself; cancelling it would leave a reference cycle
        (the task, its CancelledError, the traceback's frames) for the garbage collector, per request."""
        if self._watcher is not None and not self._complete:
            self._watcher.cancel()


def recording(
    write: Callable[[bytes], Awaitable[None]], keep: Callable[[bytes], None]
) -> Callable[[bytes], Awaitable[None]]:
    """`write`, keeping every chunk for a failure migration's transcript."""

    async def recorded(chunk: bytes) -> None:
        keep(chunk)
        await write(chunk)

    return recorded


def usage_fixer(write: Callable[[bytes], Awaitable[None]], streamed: int) -> Callable[[bytes], Awaitable[None]]:
    """`write`, with the usage event of a resumed stream counting the tokens streamed before."""

    async def fixed(chunk: bytes) -> None:
        await write(add_streamed_usage(chunk, streamed) if b'"usage"' in chunk else chunk)

    return fixed
