"""The gateway's hot path (raw ASGI): parse an OpenAI completions/chat request and hand it over.

POST /v1/completions and /v1/chat/completions are parsed and validated here, turned into a
console.live.request.LiveRequest, and run with a channel back to the client; the LiveRequest
takes every decision with the dispatcher and relays the decode stream (console/live/request.py
describes one request's life). Errors in the request itself are answered here, OpenAI-shaped.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from adapters.vllm.forward import forward_headers
from console.error_bodies import error_body, unauthorized_body
from console.live.channel import JSON_HEADERS, ClientChannel, respond
from console.live.controller import Controller
from console.live.request import LiveRequest
from core.pools import Route, UnknownModel
from core.types import Request

Scope = dict[str, Any]
INT64_MAX = 2**63 - 1
"""Integers the gateway forwards and records stay within 64 bits (what engines and SQLite hold)."""


class ClientError(Exception):
    """The client's request is malformed or names something that does not exist."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


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


async def read_bounded_body(receive: Any, limit: int) -> bytes:
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


class Proxy:
    """ASGI handler for POST /v1/completions and /v1/chat/completions."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.in_flight: set[str] = set()
        """Request ids being served: the dispatcher, the run store and the instances (KV transfer)
        key requests by id, so a client's X-Request-Id may not be in flight twice."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        c = self.c
        if c.draining:
            await respond(
                send, 503, error_body(503, "the console is shutting down"), [*JSON_HEADERS, (b"retry-after", b"5")]
            )
            return
        # header values are bytes, not necessarily UTF-8: latin-1 maps every byte (as Starlette does)
        headers = {k: v.decode("latin-1") for k, v in scope.get("headers") or []}
        tenants = c.tenants
        authorization = headers.get(b"authorization")
        tenant = tenants.authenticate(authorization)
        if tenant is None:  # before the body is read: an unknown client costs nothing more
            await respond(send, 401, unauthorized_body(authorization))
            return
        try:
            body = self._parse(await read_bounded_body(receive, c.config.max_body_bytes))
            route = self._route(body.get("model"))
        except ClientError as e:
            await respond(send, e.status, error_body(e.status, e.message, e.param))
            return
        rid = headers.get(b"x-request-id") or os.urandom(16).hex()
        if rid in self.in_flight:
            await respond(
                send, 409, error_body(409, f"a request with X-Request-Id {rid!r} is already in flight", "X-Request-Id")
            )
            return
        self.in_flight.add(rid)  # before any await (/tokenize): from here on, the same id is a 409
        try:
            slo_class = headers.get(b"x-sibyl-slo-class") or str(body.pop("slo_class", "default"))
            if slo_class not in c.config.slo:
                slo_class = "default"
            max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
            raw_priority = body.get("priority")
            priority = raw_priority if type(raw_priority) is int else 0  # not a bool
            if tenants.keyed:
                priority = tenants.priority(tenant, priority)
                if type(raw_priority) is int and priority != raw_priority:
                    body["priority"] = priority  # the engines see the tenant's band too
            else:  # an open /v1: the client names its tenant for the queue's fair share
                tenant = headers.get(b"x-sibyl-tenant") or str(body.get("user") or "")
            arrival = time.monotonic()
            lora = route.adapter
            pool = c.runtime_of[route.pool]  # the route's pool: its prefix index, its instances, its services
            tokenize = pool.dispatcher.reads_prefix or pool.advised  # the advisor re-simulates the prefix caches
            keys = pool.prefix.known_keys(body, tokenize=tokenize, lora=lora)
            if keys is None:  # a text or chat prompt for a reader of the cache: the engine tokenizes it
                keys = await pool.prefix.tokenized_keys(body, pool.instances.values(), lora)
            session = headers.get(b"x-session-id", "")
            req = Request(
                rid,
                arrival,
                estimate_prompt_tokens(body),
                int(max_tokens),
                slo_class,
                priority,
                tenant=tenant,
                prefix_keys=keys,
                session=session,
                lora=lora,
            )
            fwd = [("X-Request-Id", rid)]
            if session:
                fwd.append(("X-Session-ID", session))
            if authorization is not None and not tenants.keyed:  # a tenant's key stays in the gateway
                fwd.append(("Authorization", authorization))
            live = LiveRequest(req, scope["path"], body, forward_headers(fwd), route.pool.model)
            if c.tracing is not None:  # the client's traceparent, if any, is the root span's parent
                live.trace = c.tracing.start(headers, rid, arrival)
            await live.run(pool.services, ClientChannel(send, receive))
        finally:
            self.in_flight.discard(rid)

    def _route(self, model: str | None) -> Route:
        """The pool (and adapter) a request's `model` names: 404 in OpenAI's shape when none, naming it."""
        routes = self.c.pools
        route = routes.routes.get(model) if model is not None else routes.default
        if route is None:
            try:
                routes.resolve(model)
            except UnknownModel as e:
                if model is None:
                    raise ClientError(400, "model is required: this gateway serves several models", "model") from None
                raise ClientError(404, str(e), "model") from None
        assert route is not None
        return route

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ClientError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise ClientError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ClientError(400, "model must be a string", "model")
        if "prompt" not in body and "messages" not in body:
            raise ClientError(400, "either 'prompt' (completions) or 'messages' (chat) is required")
        for key in ("max_tokens", "max_completion_tokens"):  # both: either may be the one used
            mt = body.get(key)
            if mt is not None and (type(mt) is not int or not 1 <= mt <= INT64_MAX):
                raise ClientError(400, f"{key} must be an integer from 1 to 2^63-1", key)
        priority = body.get("priority")
        if type(priority) is int and not -INT64_MAX - 1 <= priority <= INT64_MAX:
            raise ClientError(400, "priority must be a 64-bit integer", "priority")
        return body
