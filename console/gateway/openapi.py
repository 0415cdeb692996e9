"""The gateway's OpenAPI 3 description, served at GET /openapi.json.

Written by hand from what the gateway really reads (console/gateway/proxy.py for the OpenAI
endpoints, console/gateway/control.py for /control/*), so that schema-driven fuzzing
(tests/e2e/test_fuzz_api.py) and client generators see the same contract the code enforces. The parts
that depend on the running console (served model names, instance ids, the policy catalog with each
policy's params schema) are filled in from the controller each time the schema is asked for.

Request bodies of /v1/* allow extra properties: the gateway forwards the client's body to the
instances unchanged (vLLM reads many more fields than the gateway does).
"""

from __future__ import annotations

import copy
from typing import Any

from console.gateway.advisor_routes import advisor_paths
from console.gateway.control import MAX_SCALE_DELTA
from console.gateway.inspector import inspector_paths
from console.gateway.lora_routes import lora_paths
from console.live.state import json_schema
from core.types import PolicyKind

_ERROR_REF = {"$ref": "#/components/schemas/Error"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _json_response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_UNAUTHORIZED = _error_response("missing or wrong bearer token")

_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
"""One server-sent event (before OpenAPI 3.2, a text/event-stream `schema` describes each event)."""

_HOT_ERRORS = {
    "400": _error_response("malformed body, missing prompt/messages or a bad max_tokens"),
    "404": _error_response("unknown model or adapter (the message names it)"),
    "409": _error_response("a request with this X-Request-Id is already in flight"),
    "401": _error_response("with a tenants' keys file: a missing or unknown API key (OpenAI's shape)"),
    "413": _error_response("body larger than max_body_bytes"),
    "429": _error_response(
        "the gateway queue is full, or the tenant is over its max_in_flight or tokens_per_minute (Retry-After)"
    ),
    "499": _error_response("the client left while queued"),
    "502": _error_response("an instance failed or could not be reached"),
    "503": _error_response("no capacity, queued too long, or the console is shutting down (Retry-After)"),
}


def _hot_headers() -> list[dict[str, Any]]:
    return [
        {
            "name": "X-Request-Id",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "the request id (sent on to the instances; a random one otherwise)",
        },
        {
            "name": "X-Sibyl-SLO-Class",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "SLO class (overrides the body's slo_class; unknown classes count as default)",
        },
        {
            "name": "X-Sibyl-Tenant",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "tenant for fair queueing (overrides the body's user)",
        },
    ]


def _common_fields(max_tokens_max: int | None) -> dict[str, Any]:
    tokens: dict[str, Any] = {"type": "integer", "minimum": 1}
    if max_tokens_max is not None:
        tokens["maximum"] = max_tokens_max
    return {
        "max_tokens": {"anyOf": [tokens, {"type": "null"}]},
        "max_completion_tokens": {"anyOf": [tokens, {"type": "null"}]},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "ignore_eos": {"type": "boolean"},
        "priority": {"type": "integer", "description": "lower runs earlier"},
        "slo_class": {"type": "string"},
        "user": {"type": "string", "description": "tenant, unless X-Sibyl-Tenant says"},
    }


def _model_field(models: list[str]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "description": "a served model (404 otherwise)"}
    if models:
        schema["enum"] = models
    return schema


def _policy_put_body(catalog: list[dict[str, Any]]) -> dict[str, Any]:
    """One alternative per registered policy: its name and its params schema."""
    variants: list[dict[str, Any]] = []
    for p in catalog:
        params = copy.deepcopy(p.get("params_schema") or {"type": "object"})
        params.pop("title", None)
        variants.append(
            {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "const": p["name"], "description": f"{p['kind']} policy"},
                    "params": params,
                    "source": {"type": "string"},
                    "pool": {"type": ["string", "null"], "description": "the pool (default: the only one)"},
                },
            }
        )
    if not variants:
        return {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    return {"oneOf": variants}


def build_openapi(
    *,
    models: list[str],
    instances: list[str],
    catalog: list[dict[str, Any]],
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a console serving `models` on `instances` with `catalog`."""
    common = _common_fields(max_model_len)
    completion_body = {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": True,
        "properties": {
            "model": _model_field(models),
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},  # vLLM refuses an empty prompt (400)
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                        "minItems": 1,
                    },
                ]
            },
            **common,
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"type": "string"},
        },
    }
    chat_body = {
        "type": "object",
        "required": ["messages"],
        "additionalProperties": True,
        "properties": {
            "model": _model_field(models),
            "messages": {"type": "array", "items": message, "minItems": 1},
            **common,
        },
    }
    reply = {
        "type": "object",
        "required": ["choices"],
        "properties": {"id": {"type": "string"}, "choices": {"type": "array"}, "usage": {"type": "object"}},
    }
    hot_ok = {
        "description": "the completion (text/event-stream when stream is true)",
        "content": {"application/json": {"schema": reply}, "text/event-stream": {"schema": _SSE_EVENT}},
    }
    bearer: list[dict[str, list[str]]] = [{"bearerAuth": []}]
    instance_field: dict[str, Any] = {"type": "string"}
    if instances:
        instance_field["example"] = instances[0]
    kinds = [k.value for k in PolicyKind]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sibyl-console gateway",
            "version": "1",
            "description": "OpenAI-compatible P/D gateway and the console's control API (bearer token).",
        },
        "paths": {
            "/v1/completions": {
                "post": {
                    "operationId": "createCompletion",
                    "parameters": _hot_headers(),
                    "requestBody": {"required": True, "content": {"application/json": {"schema": completion_body}}},
                    "responses": {"200": hot_ok, **_HOT_ERRORS},
                }
            },
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "parameters": _hot_headers(),
                    "requestBody": {"required": True, "content": {"application/json": {"schema": chat_body}}},
                    "responses": {"200": hot_ok, **_HOT_ERRORS},
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {
                        "200": _json_response(
                            "the served models",
                            {
                                "type": "object",
                                "required": ["object", "data"],
                                "properties": {
                                    "object": {"type": "string", "enum": ["list"]},
                                    "data": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id", "object"],
                                            "properties": {"id": {"type": "string"}, "object": {"type": "string"}},
                                        },
                                    },
                                },
                            },
                        ),
                        "401": _HOT_ERRORS["401"],
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "responses": {
                        "200": {"description": "some instance is healthy (empty body)"},
                        "503": _error_response("no healthy instance"),
                    },
                }
            },
            **inspector_paths(bearer),
            **advisor_paths(bearer, _error_response, _UNAUTHORIZED, [k.value for k in PolicyKind]),
            **lora_paths(bearer),
            "/control/state": {
                "get": {
                    "operationId": "getState",
                    "security": bearer,
                    "responses": {
                        "200": _json_response("the console's state", {"$ref": "#/components/schemas/ConsoleState"}),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/control/events": {
                "get": {
                    "operationId": "events",
                    "security": bearer,
                    "description": (
                        "server-sent events: past events, the state, then live events (never ends by itself)"
                    ),
                    "responses": {
                        "200": {
                            "description": "event stream",
                            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
                        },
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/control/policies": {
                "get": {
                    "operationId": "getPolicies",
                    "security": bearer,
                    "responses": {
                        "200": _json_response(
                            "active policies and the catalog",
                            {
                                "type": "object",
                                "required": ["active", "available"],
                                "properties": {"active": {"type": "object"}, "available": {"type": "array"}},
                            },
                        ),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/control/policies/{kind}": {
                "put": {
                    "operationId": "setPolicy",
                    "security": bearer,
                    "parameters": [
                        {"name": "kind", "in": "path", "required": True, "schema": {"type": "string", "enum": kinds}}
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _policy_put_body(catalog)}},
                    },
                    "responses": {
                        "200": _json_response(
                            "the swap", {"type": "object", "required": ["kind", "old", "new", "params", "source"]}
                        ),
                        "400": _error_response("malformed body"),
                        "401": _UNAUTHORIZED,
                        "404": _error_response("unknown policy kind"),
                        "422": _error_response("unknown policy, bad params, or a policy the backend cannot carry out"),
                    },
                }
            },
            "/control/scale": {
                "post": {
                    "operationId": "scale",
                    "security": bearer,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["role", "delta"],
                                    "properties": {
                                        "role": {"type": "string", "enum": ["prefill", "decode"]},
                                        "delta": {
                                            "type": "integer",
                                            "minimum": -MAX_SCALE_DELTA,
                                            "maximum": MAX_SCALE_DELTA,
                                            "not": {"enum": [0]},
                                        },
                                        "pool": {"type": "string", "description": "the pool (default: the only one)"},
                                        "source": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json_response(
                            "the instances added or drained",
                            {"type": "object", "required": ["role", "delta", "instances"]},
                        ),
                        "400": _error_response("malformed body"),
                        "401": _UNAUTHORIZED,
                        "404": _error_response("no such pool, or none named where several run"),
                        "409": _error_response("the backend cannot scale, or the last instance of a role would go"),
                        "422": _error_response("bad role or delta"),
                    },
                }
            },
            "/control/flip": {
                "post": {
                    "operationId": "flip",
                    "security": bearer,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["instance", "role"],
                                    "properties": {
                                        "instance": instance_field,
                                        "role": {"type": "string", "enum": ["prefill", "decode"]},
                                        "pool": {"type": "string", "description": "default: the instance's pool"},
                                        "source": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json_response("the flip", {"type": "object", "required": ["instance", "role"]}),
                        "400": _error_response("malformed body"),
                        "401": _UNAUTHORIZED,
                        "404": _error_response("no such pool"),
                        "409": _error_response(
                            "unknown instance, same role, the last active instance of its role, "
                            "or a backend that cannot flip"
                        ),
                    },
                }
            },
            "/control/migrate": {
                "post": {
                    "operationId": "migrate",
                    "security": bearer,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["request_id", "target"],
                                    "properties": {
                                        "request_id": {"type": "string"},
                                        "target": instance_field,
                                        "source": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json_response(
                            "the migration, once the KV is on the target",
                            {"type": "object", "required": ["request_id", "source", "target"]},
                        ),
                        "400": _error_response("malformed body"),
                        "401": _UNAUTHORIZED,
                        "409": _error_response(
                            "not a streaming request decoding now, not an active decode target, "
                            "a backend that cannot migrate, or a migration the source gave up"
                        ),
                    },
                }
            },
            "/control/prefix/match": {
                "post": {
                    "operationId": "prefixMatch",
                    "security": bearer,
                    "description": "Where a prompt's blocks are cached as routing sees it: a completions or chat body "
                    "in (token ids, text or messages, tokenized as for routing); out its block count in the engines' "
                    "block size and, per instance holding its first block, how many leading blocks the index says "
                    "it holds.",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "responses": {
                        "200": _json_response(
                            "the prompt's blocks and where they are held",
                            {
                                "type": "object",
                                "required": ["source", "block_size", "blocks", "match", "indexed_blocks"],
                            },
                        ),
                        "400": _error_response("not JSON, or neither a prompt nor messages"),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/control/run": {
                "get": {
                    "operationId": "getRun",
                    "security": bearer,
                    "responses": {
                        "200": _json_response("the run", {"type": "object", "required": ["run_id", "db", "run_dir"]}),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/control/tenants/reload": {
                "post": {
                    "operationId": "reloadTenants",
                    "security": bearer,
                    "description": "Read the tenants' keys file again (it is also re-read when it changes); a file "
                    "that does not load leaves the table in force.",
                    "responses": {
                        "200": _json_response(
                            "the new table is in force", {"type": "object", "required": ["ok", "error", "tenants"]}
                        ),
                        "401": _UNAUTHORIZED,
                        "409": _error_response("this console has no keys file"),
                        "422": _error_response(
                            "the file did not load (the message names the file, line and field); the old table stays"
                        ),
                    },
                }
            },
            "/control/shutdown": {
                "post": {
                    "operationId": "shutdown",
                    "security": bearer,
                    "description": "Stop the console as SIGTERM does: drain in-flight requests "
                    "(up to drain_timeout_s), stop the instances it launched, close the run. "
                    "A second stop request skips the drain.",
                    "responses": {
                        "202": _json_response(
                            "the stop has started",
                            {"type": "object", "required": ["stopping", "run_id", "drain_timeout_s"]},
                        ),
                        "401": _UNAUTHORIZED,
                        "409": _error_response("a console embedded in another program, which stops with it"),
                    },
                }
            },
            "/control/replay/{action}": {
                "post": {
                    "operationId": "replayAction",
                    "security": bearer,
                    "parameters": [
                        {
                            "name": "action",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "enum": ["pause", "resume"]},
                        }
                    ],
                    "responses": {
                        "200": _json_response("the replay's progress", {"type": "object"}),
                        "401": _UNAUTHORIZED,
                        "404": _error_response("no replay is running, or an unknown action"),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the console's control token (<run dir>/token or SIBYL_TOKEN)",
                }
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": "integer"},
                            },
                        }
                    },
                },
                **_state_schemas(),
            },
        },
    }


def _state_schemas() -> dict[str, Any]:
    """`ConsoleState` and the models it refers to, generated from console/live/state.py."""
    schema, defs = json_schema("#/components/schemas/")
    return {"ConsoleState": schema, **defs}
