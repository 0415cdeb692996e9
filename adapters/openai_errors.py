"""The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, the emulator and the gateway answer."""

from __future__ import annotations

import orjson


def openai_error_body(message: str, type_: str, param: str | None, code: int | str | None) -> bytes:
    """An error answer's JSON body; `code` is the HTTP status for vLLM's errors (OpenAI's own may name a reason)."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})
