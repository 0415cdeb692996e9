"""The request inspector's control routes: an instance's recent requests, a request's decision records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from console.error_bodies import error_body
from console.live.recent import instance_requests, request_decisions

if TYPE_CHECKING:
    from console.live.controller import Controller

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


def inspector_routes(c: Controller, guard: Any) -> list[Route]:
    """GET /control/instances/{instance}/requests and GET /control/requests/{request_id}/decisions."""

    async def requests_of(request: Request) -> Response:
        iid = request.path_params["instance"]
        pool = next((r for r in c.runtimes if iid in r.dispatcher.view.index), None)
        if pool is None:
            known = ", ".join(i for r in c.runtimes for i in r.dispatcher.view.instance_ids) or "none"
            return Response(
                error_body(404, f"unknown instance {iid!r}; instances: {known}"), 404, media_type="application/json"
            )
        raw = request.query_params.get("limit", str(DEFAULT_LIMIT))
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            return Response(
                error_body(400, f"limit must be an integer in 1..{MAX_LIMIT}"), 400, media_type="application/json"
            )
        out = c.outcomes
        rows = instance_requests(iid, out.live, c.recent, pool.dispatcher.decisions, out.rel, int(raw))
        return _json({"instance": iid, "requests": rows})

    async def decisions_of(request: Request) -> Response:
        rid = request.path_params["request_id"]
        for r in c.runtimes[1:]:  # a request is decided in one pool: the first that has records of it
            log = r.dispatcher.decisions
            if log is not None and log.of_request(rid):
                return _json(request_decisions(rid, r.dispatcher.decisions, c.t0))
        return _json(request_decisions(rid, c.dispatcher.decisions, c.t0))

    return [
        Route("/control/instances/{instance}/requests", guard(requests_of), methods=["GET"]),
        Route("/control/requests/{request_id}/decisions", guard(decisions_of), methods=["GET"]),
    ]


def _ok(description: str, required: list[str]) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"type": "object", "required": required}}},
    }


def _err(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def inspector_paths(bearer: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The inspector's part of the OpenAPI document (console/gateway/openapi.py)."""
    unauthorized = _err("missing or wrong bearer token")
    return {
        "/control/instances/{instance}/requests": {
            "get": {
                "operationId": "instanceRequests",
                "security": bearer,
                "description": "The instance's requests, newest first: in flight on it, then finished there (as "
                "prefill or decode instance, from the last 1000 finished); `decisions` says whether a request's "
                "decision records are still in memory.",
                "parameters": [
                    {"name": "instance", "in": "path", "required": True, "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
                    },
                ],
                "responses": {
                    "200": _ok("the instance's requests", ["instance", "requests"]),
                    "400": _err("a limit outside 1..1000"),
                    "401": unauthorized,
                    "404": _err("unknown instance"),
                },
            }
        },
        "/control/requests/{request_id}/decisions": {
            "get": {
                "operationId": "requestDecisions",
                "security": bearer,
                "description": "The request's decision records still in memory (the latest [decisions] keep "
                "records): each decision's candidates with their features and scores as the policy saw them, "
                "the choice, margin and ties; `note` says why there are none.",
                "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": _ok("the request's decisions", ["request_id", "decisions", "note"]),
                    "401": unauthorized,
                },
            }
        },
    }
