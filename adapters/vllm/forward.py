"""Forwarding one request through a P/D pair: the prefill leg, the decode leg, the SSE relay.

vLLM's disaggregated-proxy protocol (adapters.vllm.pd_protocol has the leg bodies): leg 1 to the
prefill instance returns `kv_transfer_params`, leg 2 hands them to the decode instance, whose
answer streams back to the client while its tokens are counted. These functions know nothing of
the console: they report through their arguments and raise UpstreamFailure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from adapters.errors import AdapterError
from adapters.http.upstream import Response, UpstreamClosed
from adapters.vllm.instances import Instance
from adapters.vllm.pd_protocol import HANDOFF_EVENT, SSETokenCounter

Write = Callable[[bytes], Awaitable[None]]
OnTokens = Callable[[int], None]
"""Called with the running token count whenever a relayed chunk completed new token events."""

CONNECTION_ERRORS = (TimeoutError, OSError)
"""What a leg raises when the instance cannot be reached or drops the connection."""


def forward_headers(pairs: list[tuple[str, str]]) -> bytes:
    """Extra request header lines for both legs; a value with a line break is dropped, not sent."""
    return b"".join(f"{k}: {v}\r\n".encode() for k, v in pairs if "\r" not in v and "\n" not in v)


class UpstreamFailure(AdapterError):
    """A leg failed: the instance could not be reached, or it answered with an error status."""

    def __init__(
        self, instance_id: str, status: int, message: str, body: bytes | None = None, delivered: bool = False
    ) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.status = status
        """The instance's status, or 502 when it could not be reached at all."""
        self.body = body
        """The instance's own error body (passed to the client for 4xx answers)."""
        self.delivered = delivered
        """The request reached the instance before its connection closed (a 502 that is not a
        refused connection): the instance may have acted on it, e.g. pulled and so freed the
        prompt's KV on the prefill instance."""

    @property
    def instance_fault(self) -> bool:
        """The instance is at fault (unreachable or 5xx), not the request: worth another instance."""
        return self.status >= 500


async def post(inst: Instance, path: str, payload: bytes, headers: bytes) -> Response:
    """POST one leg through the instance's hot-path pool (a stale pooled connection is retried there)."""
    assert inst.upstream is not None, f"instance {inst.id} has no open client"
    return await inst.upstream.post(path, payload, headers)


async def prefill_leg(inst: Instance, path: str, payload: bytes, headers: bytes) -> dict[str, Any]:
    """Leg 1: the prefill instance's JSON reply (it carries `kv_transfer_params`)."""
    try:
        async with await post(inst, path, payload, headers) as r:
            raw = await r.read()
            if r.status == 200:
                reply: dict[str, Any] = orjson.loads(raw)
                return reply
            raise UpstreamFailure(inst.id, r.status, f"prefill {inst.id} answered {r.status}", raw)
    except CONNECTION_ERRORS as e:
        raise UpstreamFailure(inst.id, 502, f"prefill {inst.id} unreachable: {type(e).__name__}: {e}") from None
    except orjson.JSONDecodeError as e:
        raise UpstreamFailure(
            inst.id, 502, f"prefill {inst.id} answered 200 with a body that is not JSON: {e}"
        ) from None


async def tokenize(inst: Instance, text: str, headers: bytes) -> list[int]:
    """The instance's token ids of `text` without special tokens (vLLM's POST /tokenize)."""
    payload = orjson.dumps({"prompt": text, "add_special_tokens": False})
    try:
        async with await post(inst, "/tokenize", payload, headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise UpstreamFailure(
                    inst.id, r.status, f"{inst.id} could not tokenize the streamed text: {r.status}", raw
                )
            tokens = orjson.loads(raw).get("tokens")
    except CONNECTION_ERRORS as e:
        raise UpstreamFailure(inst.id, 502, f"{inst.id} unreachable: {type(e).__name__}: {e}") from None
    except (orjson.JSONDecodeError, AttributeError) as e:
        raise UpstreamFailure(
            inst.id, 502, f"{inst.id} answered /tokenize with something else than JSON tokens: {e}"
        ) from None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise UpstreamFailure(inst.id, 502, f"{inst.id} answered /tokenize without a list of token ids")
    return tokens


async def open_decode(inst: Instance, path: str, payload: bytes, headers: bytes) -> Response:
    """Leg 2 up to its 200 status line (the caller releases the response); errors before the first
    byte raise UpstreamFailure."""
    try:
        r = await post(inst, path, payload, headers)
    except UpstreamClosed as e:  # written, then the connection closed before any answer
        raise UpstreamFailure(
            inst.id, 502, f"decode {inst.id} closed the connection before answering: {e}", delivered=True
        ) from None
    except CONNECTION_ERRORS as e:
        raise UpstreamFailure(inst.id, 502, f"decode {inst.id} unreachable: {type(e).__name__}: {e}") from None
    if r.status != 200:
        try:
            raw = await r.read()
        except CONNECTION_ERRORS:
            raw = b""
        finally:
            r.release()
        raise UpstreamFailure(
            inst.id, r.status, f"decode {inst.id} answered {r.status}: {raw[:200].decode(errors='replace')}", raw
        )
    return r


@contextlib.asynccontextmanager
async def decode_leg(inst: Instance, path: str, payload: bytes, headers: bytes) -> AsyncIterator[Response]:
    """Leg 2: an open 200 response from the decode instance (released on exit); errors before the
    first byte raise UpstreamFailure."""
    r = await open_decode(inst, path, payload, headers)
    try:
        yield r
    finally:
        r.release()


async def relay_stream(
    r: Response, write: Write, on_tokens: OnTokens, gone: asyncio.Event, counter: SSETokenCounter | None = None
) -> tuple[SSETokenCounter, bytes | None, bytes]:
    """Forward an SSE stream chunk by chunk while counting its tokens; stop when the client is gone.

    Returns the counter (pass it back to continue counting on another stream), the JSON of the
    instance's hand-off event when it migrated the sequence away (not forwarded), and the chunk
    that carried `[DONE]`, not yet written: the caller sends it with the end of the response, in
    one write. A connection error mid-stream raises StreamBroken; its counter says what was relayed."""
    counter = counter or SSETokenCounter()
    feed = counter.feed
    last = b""
    try:
        async for chunk in r.iter_chunks():
            if gone.is_set():
                break
            if last:  # bytes after [DONE]: not expected of vLLM, but relayed as they came
                await write(last)
                last = b""
            at = chunk.find(HANDOFF_EVENT)
            if at >= 0:
                head, handoff = chunk[:at], chunk[at + 6 :].split(b"\n\n", 1)[0]
                if head:
                    if feed(head):
                        on_tokens(counter.tokens)
                    await write(head)
                return counter, handoff, b""
            if feed(chunk):
                on_tokens(counter.tokens)
            if counter.done:
                last = chunk
            else:
                await write(chunk)
    except CONNECTION_ERRORS as e:
        if last:
            await write(last)
        raise StreamBroken(counter, f"{type(e).__name__}: {e}") from None
    return counter, None, last


class StreamBroken(AdapterError):
    """The decode stream broke after it started; `counter` holds what was relayed before."""

    def __init__(self, counter: SSETokenCounter, message: str) -> None:
        super().__init__(message)
        self.counter = counter
