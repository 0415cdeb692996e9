"""The control API under /control/: state, server-sent events, policies of every kind, scale, flip, migrate."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from console.error_bodies import error_body
from console.gateway.advisor_routes import advisor_routes
from console.gateway.inspector import inspector_routes
from console.gateway.lora_routes import lora_routes
from console.gateway.prefix_routes import prefix_routes
from console.live.controller import Controller
from console.live.migrations import ScaleError
from core.errors import ConfigError, SibylError
from core.policies.registry import catalog
from core.pools import UnknownPool
from core.types import PolicyKind

MAX_SCALE_DELTA = 16
"""The most instances one POST /control/scale may add or drain: a bigger delta is refused (422)
instead of starting that many processes from one request."""


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status, media_type="application/json")


async def _object(request: Request, expected: str, strings: tuple[str, ...] = ()) -> dict[str, Any] | Response:
    """The body's JSON object, its `strings` fields strings, or the 400 that names what was `expected`."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        return _error(400, f"malformed JSON body: {e}")
    if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in strings):
        return _error(400, f"expected {expected}")
    return body


def _authorized(request: Request, token: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, so a 500); header
    # values arrive latin-1 decoded, so this gives back the bytes the client sent
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("latin-1"), token.encode())


def control_routes(c: Controller, request_shutdown: Callable[[str], None] | None = None) -> list[Route]:
    """The /control/ routes of console `c`; `request_shutdown` (the server's stop) backs POST /control/shutdown."""

    def guard(handler: Any) -> Any:
        async def wrapped(request: Request) -> Response:
            if not _authorized(request, c.token):
                return _error(401, "missing or wrong bearer token; see the token file printed by `sibyl-console up`")
            result: Response = await handler(request)
            return result

        return wrapped

    async def state(_: Request) -> Response:
        return _json(c.state())

    async def policies(_: Request) -> Response:
        pools = {r.pool.name: r.dispatcher.active_policies() for r in c.runtimes}
        return _json({"active": c.dispatcher.active_policies(), "pools": pools, "available": catalog(live=True)})

    async def put_policy(request: Request) -> Response:
        kind = request.path_params["kind"]
        if kind not in {k.value for k in PolicyKind}:
            return _error(404, f"unknown policy kind {kind!r}; kinds: {', '.join(k.value for k in PolicyKind)}")
        body = await _object(request, '{"name": "<policy>", "params": {...}}', ("name",))
        if isinstance(body, Response):
            return body
        params = body.get("params") or {}
        if not isinstance(params, dict):
            return _error(400, "params must be an object")
        source = str(body.get("source") or request.headers.get("x-sibyl-source") or "api")
        pool = body.get("pool")
        if pool is not None and not isinstance(pool, str):
            return _error(400, "pool must be a string (a pool's name; default: the only pool)")
        try:
            ev = c.set_policy(kind, body["name"], params, source=source, pool=pool)
        except UnknownPool as e:
            return _error(404, str(e))
        except ConfigError as e:
            return _error(422, str(e))
        return _json(
            {
                "kind": ev.kind.value,
                "old": ev.old,
                "new": ev.new,
                "params": ev.params,
                "source": ev.source,
                "pool": c.pools.pick(pool).name,
            }
        )

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            for past in list(c.events.history):
                yield b"data: " + orjson.dumps(past) + b"\n\n"
            yield (
                b"data: "
                + orjson.dumps({"type": "state", "state": c.state()}, option=orjson.OPT_SERIALIZE_NUMPY)
                + b"\n\n"
            )
            async for ev in c.events.subscribe():
                if await request.is_disconnected():
                    break
                yield b"data: " + orjson.dumps(ev, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def replay_action(request: Request) -> Response:
        action = request.path_params["action"]
        if c.replay is None:
            return _error(404, "no replay is running (start one with `sibyl-console up --replay TRACE`)")
        if action not in ("pause", "resume"):
            return _error(404, f"unknown replay action {action!r}; actions: pause, resume")
        getattr(c.replay, action)()
        c.events.publish("replay", action=action, **c.replay.snapshot())
        return _json(c.replay.snapshot())

    async def scale(request: Request) -> Response:
        body = await _object(request, '{"role": "prefill"|"decode", "delta": N, "pool": "<name>"}')
        if isinstance(body, Response):
            return body
        pool = body.get("pool")
        if pool is not None and not isinstance(pool, str):
            return _error(400, "pool must be a string (a pool's name; default: the only pool)")
        delta = body.get("delta")
        if type(delta) is int and abs(delta) > MAX_SCALE_DELTA:
            return _error(
                422, f"delta must be between -{MAX_SCALE_DELTA} and {MAX_SCALE_DELTA} per request, got {delta}"
            )
        try:
            runtime = c.runtime(pool)
            result = await runtime.operations.scale(
                str(body.get("role")),
                body.get("delta"),  # type: ignore[arg-type]
                source=str(body.get("source") or "api"),
            )
        except UnknownPool as e:
            return _error(404, str(e))
        except ScaleError as e:
            return _error(409 if "must remain" in str(e) or "cannot" in str(e) else 422, str(e))
        except SibylError as e:  # the backend refused (a missing capability, an instance that did not start)
            return _error(409, str(e))
        return _json({**result, "pool": runtime.pool.name} if len(c.runtimes) > 1 else result)

    async def flip(request: Request) -> Response:
        body = await _object(request, '{"instance": "<id>", "role": "prefill"|"decode"}', ("instance", "role"))
        if isinstance(body, Response):
            return body
        pool = body.get("pool")
        if pool is not None and not isinstance(pool, str):
            return _error(400, "pool must be a string (a pool's name; default: the instance's pool)")
        try:  # instance ids are unique across pools: the instance names its pool unless one is given
            runtime = c.runtime(pool) if pool is not None else c.runtime_with(body["instance"]) or c.runtimes[0]
            result = await runtime.operations.flip(
                body["instance"], body["role"], source=str(body.get("source") or "api")
            )
        except UnknownPool as e:
            return _error(404, str(e))
        except SibylError as e:
            return _error(409, str(e))
        return _json({**result, "pool": runtime.pool.name} if len(c.runtimes) > 1 else result)

    async def migrate(request: Request) -> Response:
        body = await _object(
            request, '{"request_id": "<id>", "target": "<decode instance id>"}', ("request_id", "target")
        )
        if isinstance(body, Response):
            return body
        runtime = c.runtime_with(body["target"]) or c.runtimes[0]  # a move stays within the target's pool
        try:
            result = await runtime.migrations.migrate(
                body["request_id"], body["target"], source=str(body.get("source") or "api")
            )
        except SibylError as e:
            return _error(409, str(e))
        return _json(result)

    async def run(_: Request) -> Response:
        return _json({"run_id": c.run_id, "db": str(c.store.path), "run_dir": str(c.run_dir)})

    async def tenants_reload(_: Request) -> Response:
        try:
            result = c.tenants.reload("api")
        except ConfigError as e:  # no keys file configured
            return _error(409, str(e))
        if not result["ok"]:
            return _error(422, f"not reloaded, the table in force stays: {result['error']}")
        return _json(result)

    async def shutdown(_: Request) -> Response:
        if request_shutdown is None:
            return _error(
                409, "this console cannot be stopped through its control API (it is embedded in another program)"
            )
        request_shutdown("control API")
        return _json({"stopping": True, "run_id": c.run_id, "drain_timeout_s": c.config.drain_timeout_s}, 202)

    return [
        Route("/control/state", guard(state), methods=["GET"]),
        Route("/control/events", guard(events), methods=["GET"]),
        Route("/control/policies", guard(policies), methods=["GET"]),
        Route("/control/policies/{kind}", guard(put_policy), methods=["PUT"]),
        Route("/control/run", guard(run), methods=["GET"]),
        Route("/control/tenants/reload", guard(tenants_reload), methods=["POST"]),
        Route("/control/replay/{action}", guard(replay_action), methods=["POST"]),
        Route("/control/scale", guard(scale), methods=["POST"]),
        Route("/control/flip", guard(flip), methods=["POST"]),
        Route("/control/migrate", guard(migrate), methods=["POST"]),
        Route("/control/shutdown", guard(shutdown), methods=["POST"]),
        *inspector_routes(c, guard),
        *advisor_routes(c, guard),
        *prefix_routes(c, guard),
        *lora_routes(c, guard),
    ]
