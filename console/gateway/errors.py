"""OpenAI-style error bodies, shaped like vLLM 0.32's."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "BadRequestError",
    422: "BadRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param, "code": status}}
    )


def sse_error(status: int, message: str) -> bytes:
    """An error event for a stream that already started (the status line is already 200)."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
