"""Assembles the gateway: the raw-ASGI hot path for completions plus Starlette for everything else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from console.error_bodies import error_body, unauthorized_body
from console.gateway.control import control_routes
from console.gateway.openapi import build_openapi
from console.gateway.proxy import Proxy
from console.live.controller import Controller
from core.policies.registry import catalog

HOT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def build_app(
    controller: Controller, *, manage_lifecycle: bool = True, request_shutdown: Callable[[str], None] | None = None
) -> Any:
    """The ASGI app. With `manage_lifecycle` the app's lifespan starts and stops the controller;
    `request_shutdown` (the serving process's stop) backs `POST /control/shutdown`."""
    c = controller

    async def health(_: Request) -> Response:
        healthy = any(i.healthy for i in c.instances.values())
        return Response(b"" if healthy else error_body(503, "no healthy instance"), 200 if healthy else 503)

    async def models(request: Request) -> Response:
        authorization = request.headers.get("authorization")
        if c.tenants.authenticate(authorization) is None:  # /v1 takes the same keys as the completions
            return Response(unauthorized_body(authorization), 401, media_type="application/json")
        data = c.pools.cards(int(c.started_wall), c.max_model_len)  # every pool's models, adapters with their parent
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def openapi(_: Request) -> Response:
        doc = build_openapi(
            models=sorted(c.pools.routes),
            instances=list(c.instances),
            catalog=catalog(live=True),
            max_model_len=c.max_model_len,
        )
        return Response(orjson.dumps(doc), media_type="application/json")

    async def hot_path_elsewhere(_: Request) -> Response:  # never reached: `app` below sends these POSTs to the proxy
        return Response(error_body(500, "the proxy did not take this request"), 500, media_type="application/json")

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(c.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if manage_lifecycle:
            await c.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await c.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        return Response(
            error_body(404, f"no route {request.method} {request.url.path}"), 404, media_type="application/json"
        )

    async def not_allowed(request: Request, exc: Exception) -> Response:
        allow = getattr(exc, "headers", None) or {}
        return Response(
            error_body(405, f"method {request.method} not allowed on {request.url.path}"),
            405,
            headers=allow,
            media_type="application/json",
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *(Route(path, hot_path_elsewhere, methods=["POST"]) for path in sorted(HOT_PATHS)),  # other methods: 405
        *control_routes(c, request_shutdown),
    ]
    starlette = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    proxy = Proxy(c)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in HOT_PATHS and scope["method"] == "POST":
            await proxy(scope, receive, send)
        else:
            await starlette(scope, receive, send)

    app.controller = c  # type: ignore[attr-defined]
    return app
