"""OpenAI/vLLM request parsing and the response, SSE and error shapes vLLM 0.32 produces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from adapters.emulator.tokens import count_messages, count_prompt

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}})


@dataclass
class GenRequest:
    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    """Tokens the client allows, after cutting to the context window."""
    ignore_eos: bool
    min_tokens: int
    priority: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer", key)
    return v


def parse_request(raw: bytes, *, chat: bool, served_model: str, max_model_len: int) -> GenRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model") or served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    n_prompt = count_messages(body.get("messages")) if chat else count_prompt(body.get("prompt"))
    if n_prompt is None:
        field = "messages" if chat else "prompt"
        raise ApiError(400, f"'{field}' is required: {'a list of messages' if chat else 'a string or a list of token ids'}", field)
    if n_prompt > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    room = max_model_len - n_prompt
    requested = _int(body, "max_completion_tokens", None) if chat else None
    requested = requested if requested is not None else _int(body, "max_tokens", None if chat else 16)
    if requested is not None and requested < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise ApiError(400, f"the prompt ({n_prompt} tokens) leaves no room to generate within {max_model_len} tokens", "max_tokens")
    min_tokens = _int(body, "min_tokens", 0) or 0
    opts = body.get("stream_options") or {}
    kv = body.get("kv_transfer_params")
    return GenRequest(
        chat=chat,
        model=model,
        prompt_tokens=n_prompt,
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        min_tokens=max(0, min(min_tokens, max_tokens)),
        priority=_int(body, "priority", 0) or 0,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        kv_transfer_params=kv if isinstance(kv, dict) else None,
    )


class Formatter:
    """Pre-encoded pieces of one response, so each streamed token costs one bytes join."""

    def __init__(self, req: GenRequest, request_id: str, created: int) -> None:
        self.req = req
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + request_id
        self.created = created
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        head = orjson.dumps({"id": self.id, "object": obj, "created": created, "model": req.model})[:-1]
        self._head = b"data: " + head + b',"choices":[{"index":0,'

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> bytes:
        fr = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        t = orjson.dumps(text)
        if self.req.chat:
            role = b'"role":"assistant",' if first else b""
            return self._head + b'"delta":{' + role + b'"content":' + t + b'},"logprobs":null,"finish_reason":' + fr + b"}]}\n\n"
        return self._head + b'"text":' + t + b',"logprobs":null,"finish_reason":' + fr + b',"stop_reason":null}]}\n\n'

    def usage_chunk(self, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return b"data: " + orjson.dumps(
            {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": [], "usage": self._usage(completion_tokens)}
        ) + b"\n\n"

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        p = self.req.prompt_tokens
        return {"prompt_tokens": p, "total_tokens": p + completion_tokens, "completion_tokens": completion_tokens}

    def full(self, text: str, finish_reason: str, completion_tokens: int, kv_transfer_params: dict[str, Any] | None) -> bytes:
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []}, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        return orjson.dumps(
            {
                "id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": [choice],
                "usage": self._usage(completion_tokens), "kv_transfer_params": kv_transfer_params,
            }
        )
