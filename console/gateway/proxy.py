"""The hot path: OpenAI completions/chat through a prefill and a decode instance (raw ASGI).

Per request: parse and validate → Dispatcher.route → leg 1 to prefill (retried once on another
prefill instance if it fails before any byte reached the client) → leg 2 to decode with P's
`kv_transfer_params`, streamed back while counting tokens → outcome to dispatcher and recorder.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import orjson

from adapters.vllm.pd_protocol import (
    SSETokenCounter,
    completion_tokens,
    decode_leg_body,
    prefill_leg_body,
)
from console.controller import Controller, RequestOutcome
from console.gateway.errors import error_body, sse_error
from console.instances import Instance
from core.errors import NoCapacityError
from core.types import Request

Scope = dict[str, Any]
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class ClientError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class UpstreamFailure(Exception):
    """A leg failed: connection error, or a 5xx answer."""

    def __init__(self, status: int, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, body


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Token ids count as themselves; text as ≈ 4 bytes per token (routing needs an estimate only)."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return max(1, len(text.encode()) // 4)
    if isinstance(prompt, str):
        return max(1, len(prompt.encode()) // 4)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        first = prompt[0]
        if isinstance(first, list):
            return max(1, len(first))
        if isinstance(first, str):
            return max(1, len(first.encode()) // 4)
    return 1


async def read_body(receive: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientError(400, "client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ClientError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Proxy:
    """ASGI handler for POST /v1/completions and /v1/chat/completions."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        c = self.c
        if c.draining:
            await respond(send, 503, error_body(503, "the console is shutting down"))
            return
        try:
            body = self._parse(await read_body(receive, c.config.max_body_bytes))
        except ClientError as e:
            await respond(send, e.status, error_body(e.status, e.message, e.param))
            return
        headers = dict(scope.get("headers") or [])
        rid = (headers.get(b"x-request-id") or uuid.uuid4().hex.encode()).decode()
        slo_class = (headers.get(b"x-sibyl-slo-class") or str(body.pop("slo_class", "default")).encode()).decode()
        if slo_class not in c.config.slo:
            slo_class = "default"
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        raw_priority = body.get("priority")
        priority = raw_priority if isinstance(raw_priority, int) else 0
        now = time.monotonic()
        req = Request(rid, now, estimate_prompt_tokens(body), int(max_tokens), slo_class, priority)
        try:
            t = time.perf_counter()
            assignment = c.dispatcher.route(req, now)
            c.metrics.decision.observe(time.perf_counter() - t)
        except NoCapacityError as e:
            await respond(send, 503, error_body(503, f"no capacity: {e}; try again when instances recover"))
            c.request_started()  # recorded like any other failure: the run store keeps every request
            c.request_done(RequestOutcome(
                request_id=rid, arrival=now, prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens,
                slo_class=slo_class, priority=priority, prefill_instance=None, decode_instance=None, prefill_start=None,
                prefill_end=None, decode_start=None, first_token=None, finish=time.monotonic(), output_tokens=0, ok=False,
                reason=f"no capacity: {e}",
            ))
            return
        fwd = [("X-Request-Id", rid)]
        if b"authorization" in headers:
            fwd.append(("Authorization", headers[b"authorization"].decode()))
        c.request_started()
        outcome = RequestOutcome(
            request_id=rid, arrival=now, prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens,
            slo_class=slo_class, priority=priority, prefill_instance=assignment.prefill,
            decode_instance=assignment.decode, prefill_start=None, prefill_end=None, decode_start=None,
            first_token=None, finish=now, output_tokens=0, ok=False,
        )
        try:
            await self._serve(scope["path"], body, fwd, rid, outcome, send, receive)
        finally:
            outcome.finish = time.monotonic()
            if outcome.ok:
                c.dispatcher.on_finish(rid, outcome.finish, outcome.output_tokens)
            else:
                c.dispatcher.on_fail(rid, outcome.finish)
            c.request_done(outcome)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ClientError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise ClientError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.c.served_models:
            raise ClientError(404, f"The model `{model}` does not exist.", "model")
        if "prompt" not in body and "messages" not in body:
            raise ClientError(400, "either 'prompt' (completions) or 'messages' (chat) is required")
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt is not None and (not isinstance(mt, int) or mt < 1):
            raise ClientError(400, "max_tokens must be an integer >= 1", "max_tokens")
        return body

    async def _prefill(self, path: str, body: dict[str, Any], fwd: list[tuple[str, str]], rid: str, o: RequestOutcome) -> dict[str, Any]:
        """Leg 1, retried once on another prefill instance if it fails."""
        c = self.c
        payload = orjson.dumps(prefill_leg_body(body))
        tried: list[str] = []
        while True:
            inst = c.instances[o.prefill_instance or ""]
            o.prefill_start = time.monotonic()
            c.dispatcher.on_prefill_start(rid, o.prefill_start)
            try:
                async with await _post(inst, path, payload, fwd) as r:
                    raw = await r.read()
                    if r.status == 200:
                        o.prefill_end = time.monotonic()
                        c.dispatcher.on_prefill_end(rid, o.prefill_end, o.prefill_end - o.prefill_start)
                        inst.routed += 1
                        reply: dict[str, Any] = orjson.loads(raw)
                        return reply
                    if r.status < 500:
                        raise UpstreamFailure(r.status, f"prefill {inst.id} answered {r.status}", raw)
                    failure = UpstreamFailure(r.status, f"prefill {inst.id} answered {r.status}", raw)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                failure = UpstreamFailure(502, f"prefill {inst.id} unreachable: {type(e).__name__}: {e}")
                c.upstream_failed(inst.id)
            tried.append(inst.id)
            new = c.dispatcher.retry_prefill(rid, tried, time.monotonic()) if len(tried) < 2 else None
            if new is None:
                raise failure
            o.prefill_instance = new

    async def _serve(self, path: str, body: dict[str, Any], fwd: list[tuple[str, str]], rid: str, o: RequestOutcome, send: Any, receive: Any) -> None:
        c = self.c
        try:
            reply = await self._prefill(path, body, fwd, rid, o)
        except UpstreamFailure as e:
            o.reason = str(e)
            status = e.status if e.status < 500 else 502
            await respond(send, e.status if e.status < 500 and e.body else status, e.body if e.status < 500 and e.body else error_body(status, str(e)))
            return
        dec = c.instances[o.decode_instance or ""]
        payload = orjson.dumps(decode_leg_body(body, reply.get("kv_transfer_params")))
        stream = bool(body.get("stream"))
        o.decode_start = time.monotonic()
        c.dispatcher.on_decode_start(rid, o.decode_start)
        started = False
        try:
            async with await _post(dec, path, payload, fwd) as r:
                if r.status != 200:
                    raw = await r.read()
                    o.reason = f"decode {dec.id} answered {r.status}: {raw[:200].decode(errors='replace')}"
                    if r.status >= 500:
                        c.upstream_failed(dec.id)
                    await respond(send, r.status, raw or error_body(r.status, o.reason))
                    return
                dec.routed += 1
                if not stream:
                    raw = await r.read()
                    o.first_token = time.monotonic()
                    o.output_tokens = completion_tokens(orjson.loads(raw))
                    o.ok = True
                    await respond(send, 200, raw, [*JSON_HEADERS, (b"x-request-id", rid.encode())])
                    return
                await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, (b"x-request-id", rid.encode())]})
                started = True
                counter = SSETokenCounter()
                progress = c.dispatcher.on_progress
                gone = asyncio.Event()
                watcher = asyncio.create_task(_watch_disconnect(receive, gone))
                try:
                    await self._relay(r, counter, progress, rid, o, send, gone)
                finally:
                    watcher.cancel()
                if gone.is_set():
                    o.reason = f"client disconnected mid-stream after {counter.tokens} tokens"
                    return
                o.output_tokens = counter.output_tokens
                if counter.done and counter.error is None:
                    o.ok = True
                else:
                    o.reason = f"decode {dec.id} stream ended early: {counter.error or 'no [DONE]'}"
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            o.reason = f"decode {dec.id} failed{' mid-stream' if started else ''}: {type(e).__name__}: {e}"
            c.upstream_failed(dec.id)
            if started:
                await send({"type": "http.response.body", "body": sse_error(502, o.reason), "more_body": False})
            else:
                await respond(send, 502, error_body(502, o.reason))

    @staticmethod
    async def _relay(r: aiohttp.ClientResponse, counter: SSETokenCounter, progress: Any, rid: str, o: RequestOutcome, send: Any, gone: asyncio.Event) -> None:
        """Forward the decode stream chunk by chunk, counting tokens; stop when the client is gone."""
        async for chunk in r.content.iter_any():
            if gone.is_set():
                return
            if counter.feed(chunk):
                now = time.monotonic()
                if o.first_token is None:
                    o.first_token = now
                progress(rid, counter.tokens, now)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _post(inst: Instance, path: str, payload: bytes, fwd: list[tuple[str, str]]) -> aiohttp.ClientResponse:
    """POST one leg. A request that could not even be written (a pooled connection the instance
    closed meanwhile, e.g. its keep-alive ran out while this side was slow) never reached the
    instance, so it is sent once more on another connection."""
    assert inst.session is not None
    headers = [*fwd, ("Content-Type", "application/json")]
    try:
        return await inst.session.post(path, data=payload, headers=headers)
    except aiohttp.ClientOSError as e:
        if "Can not write request body" not in str(e):
            raise
        return await inst.session.post(path, data=payload, headers=headers)


async def _watch_disconnect(receive: Any, gone: asyncio.Event) -> None:
    """The request body is read already, so the next ASGI message is the client going away."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            gone.set()
            return
