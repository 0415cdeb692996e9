"""The pools' LoRA adapters through the control API: list, add (checked, then loaded in the pool), remove."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.vllm.lora import AdapterCallError
from console.error_bodies import error_body
from core.errors import ConfigError
from core.pools import UnknownModel, UnknownPool

if TYPE_CHECKING:
    from console.live.controller import Controller


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status, media_type="application/json")


def lora_routes(c: Controller, guard: Any) -> list[Route]:
    """GET /control/lora, POST /control/lora {name, path, pool?}, DELETE /control/lora/{name}."""

    async def listing(_: Request) -> Response:
        return _json({"pools": c.lora.snapshot()})

    async def add(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return _error(400, f"malformed JSON body: {e}")
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("name"), str)
            or not isinstance(body.get("path"), str)
            or not isinstance(body.get("pool"), str | None)
        ):
            return _error(400, 'expected {"name": "<adapter>", "path": "<adapter directory>", "pool": "<pool>"?}')
        try:
            result = await c.lora.add(body["name"], body["path"], body.get("pool"))
        except UnknownPool as e:
            return _error(404, str(e))
        except ConfigError as e:  # no adapter at the path, or a name already taken: nothing was touched
            return _error(422, str(e))
        except AdapterCallError as e:  # every instance refused it: the adapter was not kept
            return _error(502, str(e))
        return _json(result)

    async def remove(request: Request) -> Response:
        try:
            result = await c.lora.remove(request.path_params["name"])
        except UnknownModel as e:
            return _error(404, str(e))
        return _json(result)

    return [
        Route("/control/lora", guard(listing), methods=["GET"]),
        Route("/control/lora", guard(add), methods=["POST"]),
        Route("/control/lora/{name}", guard(remove), methods=["DELETE"]),
    ]


def lora_paths(bearer: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The adapter routes' part of the OpenAPI document (console/gateway/openapi.py)."""

    def err(description: str) -> dict[str, Any]:
        return {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    def ok(description: str, required: list[str]) -> dict[str, Any]:
        schema = {"type": "object", "required": required}
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    unauthorized = err("missing or wrong bearer token")
    return {
        "/control/lora": {
            "get": {
                "operationId": "listLora",
                "security": bearer,
                "description": "Every pool's LoRA adapters: path, the instances holding each, requests running under "
                "each, and the pool's hits, misses, loads, evictions and load failures.",
                "responses": {"200": ok("the adapters by pool", ["pools"]), "401": unauthorized},
            },
            "post": {
                "operationId": "addLora",
                "security": bearer,
                "description": "Register a LoRA adapter with a pool (default: the only one) and load it on one "
                "prefill and one decode instance through vLLM's /v1/load_lora_adapter. A path without "
                "adapter_config.json is refused before any instance is touched.",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["name", "path"],
                                "properties": {
                                    "name": {"type": "string", "minLength": 1},
                                    "path": {"type": "string", "minLength": 1},
                                    "pool": {"type": ["string", "null"]},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": ok("where it was loaded", ["adapter", "pool", "path", "loaded_on", "errors"]),
                    "400": err("malformed body"),
                    "401": unauthorized,
                    "404": err("no such pool, or none named while several run"),
                    "422": err("no adapter at the path, or the name is already a model or adapter"),
                    "502": err("no instance could load it (each instance and vLLM's message named); not kept"),
                },
            },
        },
        "/control/lora/{name}": {
            "delete": {
                "operationId": "removeLora",
                "security": bearer,
                "description": "Unregister an adapter (requests naming it get 404 from then on) and unload it "
                "from every instance holding it.",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": ok("where it was unloaded from", ["adapter", "pool", "unloaded_from", "errors"]),
                    "401": unauthorized,
                    "404": err("no such adapter"),
                },
            }
        },
    }
