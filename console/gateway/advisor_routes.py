"""The advisor's and the policy canary's control routes, and their part of the OpenAPI document."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from console.error_bodies import error_body
from console.errors import ConsoleError
from console.live.canary import CanaryBusy
from core.errors import ConfigError

if TYPE_CHECKING:
    from console.live.controller import Controller

CANARY_BODY = (
    '{"kind": "routing", "name": "<policy>", "params": {...}, "share": "10%", "duration_s": 300, "pool": "<name>"}'
)


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status, media_type="application/json")


def advisor_routes(c: Controller, guard: Any) -> list[Route]:
    """GET /control/advice; GET, POST and DELETE /control/canary."""

    async def advice(_: Request) -> Response:
        return _json(c.advisor.answer_json())

    async def canary(_: Request) -> Response:
        return _json(c.canary.snapshot())

    async def start(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return _error(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("kind", "name")):
            return _error(400, f"expected {CANARY_BODY}")
        params, share, duration = body.get("params") or {}, body.get("share"), body.get("duration_s")
        if not isinstance(params, dict):
            return _error(400, "params must be an object")
        pool = body.get("pool")
        if pool is not None and not isinstance(pool, str):
            return _error(400, "pool must be a string (a pool's name; default: the first pool)")
        if not isinstance(share, str | int | float) or isinstance(share, bool):
            return _error(422, 'share is required: a percentage like "10%" or a fraction like 0.1, in (0, 50%]')
        if not isinstance(duration, int | float) or isinstance(duration, bool):
            return _error(422, "duration_s is required: how many seconds the canary runs before its verdict")
        try:
            started = await c.canary.start(
                body["kind"],
                body["name"],
                params,
                share,
                float(duration),
                source=str(body.get("source") or "api"),
                pool=pool,
            )
        except CanaryBusy as e:
            return _error(409, str(e))
        except (ConfigError, ConsoleError) as e:  # unknown policy, param or pool, a kind that cannot be split, a share
            return _error(422, str(e))
        return _json(started)

    async def stop(request: Request) -> Response:
        source = request.query_params.get("source", "api")
        ended = c.canary.interrupt(f"stopped by the operator ({source})")
        if ended is None:
            return _error(409, "no canary is running")
        return _json(ended)

    return [
        Route("/control/advice", guard(advice), methods=["GET"]),
        Route("/control/canary", guard(canary), methods=["GET"]),
        Route("/control/canary", guard(start), methods=["POST"]),
        Route("/control/canary", guard(stop), methods=["DELETE"]),
    ]


def advisor_paths(
    bearer: list[dict[str, list[str]]], error: Any, unauthorized: dict[str, Any], kinds: list[str]
) -> dict[str, Any]:
    """The OpenAPI paths of `advisor_routes` (`error(description)` makes an error response)."""

    def ok(description: str, required: list[str]) -> dict[str, Any]:
        schema = {"type": "object", "required": required}
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    return {
        "/control/advice": {
            "get": {
                "operationId": "getAdvice",
                "security": bearer,
                "description": "The what-if advisor's latest advice: the recent window re-simulated under the active "
                "policies and each candidate, ranked, with predicted TTFT/TPOT p50/p99, SLO attainment, refusals and "
                "prefix hit rate, the active policies' observed figures, the advisor's error and the bound a gain "
                "must clear (`shown`); `pool` is the pool advised on ([advisor] pool, default the first); `advice` "
                "is null until the first period, and `enabled` false when [advisor] is off.",
                "responses": {
                    "200": ok("the advice and the advisor's state", ["enabled", "advice"]),
                    "401": unauthorized,
                },
            }
        },
        "/control/canary": {
            "get": {
                "operationId": "getCanary",
                "security": bearer,
                "responses": {
                    "200": ok("the running canary (null: none) and the last one that ended", ["running", "last"]),
                    "401": unauthorized,
                },
            },
            "post": {
                "operationId": "startCanary",
                "security": bearer,
                "description": "Route `share` of pool `pool`'s new requests (default: the first pool's; hashed by "
                "session, else tenant, else request id) under a candidate routing or rank policy for `duration_s`, "
                "compare the arms, and end by the rule: promote (swap it in on that pool, source canary), rollback, "
                "equal or inconclusive. One canary runs at a time on the console, whichever its pool.",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["kind", "name", "share", "duration_s"],
                                "properties": {
                                    "kind": {"type": "string", "enum": kinds},
                                    "name": {"type": "string"},
                                    "params": {"type": "object"},
                                    "share": {
                                        "oneOf": [
                                            {"type": "string", "pattern": "^[0-9.]+%$"},
                                            {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
                                        ]
                                    },
                                    "duration_s": {"type": "number", "exclusiveMinimum": 0},
                                    "source": {"type": "string"},
                                    "pool": {
                                        "type": "string",
                                        "description": "the pool to canary on (a pool's name; default: the first)",
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": ok("the canary started", ["id", "plan", "pool"]),
                    "400": error("malformed body"),
                    "401": unauthorized,
                    "409": error("a canary is already running"),
                    "422": error(
                        "unknown policy or bad params, a kind that cannot be split (queue, reschedule, scaling), "
                        "a share outside (0, 50%], a duration that is not positive, or an unknown pool (the message "
                        "names the pools)"
                    ),
                },
            },
            "delete": {
                "operationId": "stopCanary",
                "security": bearer,
                "description": "End the running canary as interrupted: the active policy stays in force.",
                "responses": {
                    "200": ok("the canary's end", ["id", "decision"]),
                    "401": unauthorized,
                    "409": error("no canary is running"),
                },
            },
        },
    }
