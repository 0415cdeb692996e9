"""OpenAI-style error bodies, shaped like vLLM 0.32's."""

from __future__ import annotations

from adapters.openai_errors import openai_error_body

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
    """The gateway's error answer: vLLM's shape, typed by this gateway's own table (422 is a BadRequestError here)."""
    return openai_error_body(message, _TYPES.get(status, "APIError"), param, status)


def sse_error(status: int, message: str) -> bytes:
    """An error event for a stream that already started (the status line is already 200)."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"


def unauthorized_body(authorization: str | None) -> bytes:
    """401 for /v1 without a valid tenant key, in OpenAI's own shape (type invalid_request_error; code
    invalid_api_key for a wrong key, null for a missing one); the key is never echoed."""
    if authorization:
        message = "Incorrect API key provided. The gateway's tenants' keys file lists the keys it accepts."
        code: str | None = "invalid_api_key"
    else:
        message, code = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
            "auth (i.e. Authorization: Bearer YOUR_KEY).",
            None,
        )
    return openai_error_body(message, "invalid_request_error", None, code)
