"""OpenAI/vLLM request parsing and the response, SSE and error shapes vLLM 0.32 produces.

Errors follow vLLM's handlers: request-shape problems (malformed JSON, wrong field types, no
prompt) are FastAPI validation errors, answered 400 with type "Bad Request" and a `param` such as
"body.max_tokens"; an unknown model is 404 "NotFoundError"; serving-level checks (prompt not
shorter than the context, max_tokens < 1, min_tokens out of range) are 400 "BadRequestError";
a failed KV load is 500 "InternalServerError" with message "Internal server error". Bodies are
`{"error": {"message", "type", "param", "code"}}`. As in vLLM, a request without `model` is served
by the served model, and max_tokens beyond the context is cut to what fits (finish "length").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from adapters.emulator.tokens import (
    chat_ids,
    continued_from,
    continued_from_ids,
    count_messages,
    count_prompt,
    prompt_ids,
    token_json,
)
from adapters.openai_errors import openai_error_body

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
VALIDATION = "Bad Request"
"""vLLM's type for FastAPI request-validation errors (HTTPStatus.BAD_REQUEST.phrase)."""


class ErrorAnswer(Exception):
    """An error answer: status plus vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ERROR_TYPES.get(status, "APIError")

    def body(self) -> bytes:
        return openai_error_body(self.message, self.type, self.param, self.status)


def _invalid(loc: tuple[str | int, ...], kind: str, msg: str, param: str | None = None) -> ErrorAnswer:
    """A FastAPI-style validation error (vLLM answers these 400 "Bad Request")."""
    err = {"type": kind, "loc": ("body", *loc), "msg": msg}
    return ErrorAnswer(400, f"1 validation error:\n  {err}", param or ".".join(map(str, ("body", *loc))), VALIDATION)


@dataclass(slots=True)
class GenRequest:
    """A validated completions or chat request, reduced to what the engine needs."""

    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    """Tokens the client allows, cut to what fits in the context window."""
    ignore_eos: bool
    min_tokens: int
    priority: int
    stream: bool
    include_usage: bool
    seed: int | None
    kv_transfer_params: dict[str, Any] | None
    first_token_index: int = 0
    """The prompt ends with this many of the emulator's own tokens: generation continues there
    (adapters/emulator/tokens.py)."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids (stand-ins for text, tokens.py), when the caller asked for them."""
    lora: str | None = None
    """The LoRA adapter its `model` names (None: the base model); `model` is then the adapter's name."""


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _invalid((key,), "int_type", "Input should be a valid integer")
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _invalid((key,), "bool_type", "Input should be a valid boolean")
    return v


def parse_request(
    raw: bytes,
    *,
    chat: bool,
    served_model: str,
    max_model_len: int,
    want_ids: bool = False,
    adapter_of: Callable[[str], str | None] | None = None,
) -> GenRequest:
    """Validate a request body the way vLLM 0.32 does; raises ErrorAnswer. `want_ids`: also give the
    prompt's token ids (prefix caching needs them). `adapter_of` resolves a `model` other than the
    served one to its LoRA adapter (raising vLLM's 404 when it names none); without it such a model is 404."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        pos = getattr(e, "pos", 0)
        raise ErrorAnswer(
            400,
            f"1 validation error:\n  {{'type': 'json_invalid', 'loc': ('body', {pos}), "
            f"'msg': 'JSON decode error', 'input': {{}}, 'ctx': {{'error': {e.msg!r}}}}}",
            f"body.{pos}",
            VALIDATION,
        ) from None
    if not isinstance(body, dict):
        raise _invalid(
            (), "model_attributes_type", "Input should be a valid dictionary or object to extract fields from", "body"
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid(("model",), "string_type", "Input should be a valid string")
    stream = _bool(body, "stream")
    ignore_eos = _bool(body, "ignore_eos")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _invalid(("stream_options",), "model_type", "Input should be an object")
    if opts and not stream:
        raise _invalid(
            (), "value_error", "Value error, Stream options can only be defined when `stream=True`.", "stream_options"
        )
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise _invalid(("kv_transfer_params",), "dict_type", "Input should be a valid dictionary")
    if chat:
        if "messages" not in body:
            raise _invalid(("messages",), "missing", "Field required")
        n_prompt = count_messages(body["messages"])
        if n_prompt is None:
            raise _invalid(("messages",), "list_type", "Input should be a non-empty list of message objects")
        requested = _int(body, "max_completion_tokens", None)
        requested = requested if requested is not None else _int(body, "max_tokens", None)
        first = _continued_message(body)
    else:
        n_prompt = count_prompt(body.get("prompt"))
        if n_prompt is None:
            raise _invalid(
                (),
                "value_error",
                "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
                "prompt",
            )
        requested = _int(body, "max_tokens", 16)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            first = continued_from_ids(prompt)
        else:
            text = (
                prompt
                if isinstance(prompt, str)
                else prompt[0]
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
                else ""
            )
            first = continued_from(text)
    min_tokens = _int(body, "min_tokens", 0) or 0
    priority = _int(body, "priority", 0) or 0
    seed = _int(body, "seed", None)
    lora = None
    if model is not None and model != served_model:
        if adapter_of is None:
            raise ErrorAnswer(404, f"The model `{model}` does not exist.", "model")
        lora = adapter_of(model)
    if n_prompt >= max_model_len:
        raise ErrorAnswer(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    room = max_model_len - n_prompt
    if requested is not None and requested < 1:
        raise ErrorAnswer(400, f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    max_tokens = room if requested is None else min(requested, room)
    if min_tokens < 0:
        raise ErrorAnswer(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens")
    if min_tokens > max_tokens:
        raise ErrorAnswer(
            400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.", "min_tokens"
        )
    return GenRequest(
        chat=chat,
        model=lora or served_model,
        prompt_tokens=n_prompt,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        priority=priority,
        stream=stream,
        include_usage=bool(opts and opts.get("include_usage")),
        seed=seed,
        kv_transfer_params=kv,
        first_token_index=first,
        prompt_ids=(chat_ids(body["messages"]) if chat else prompt_ids(body.get("prompt"))) if want_ids else None,
        lora=lora,
    )


def _continued_message(body: dict[str, Any]) -> int:
    """Where generation resumes in a chat that asks to continue its final (assistant) message."""
    if not _bool(body, "continue_final_message"):
        return 0
    add_prompt = body.get("add_generation_prompt", True)
    if add_prompt is True:
        raise ErrorAnswer(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None, VALIDATION
        )
    last = body["messages"][-1]
    content = last.get("content") if last.get("role") == "assistant" else None
    return continued_from(content) if isinstance(content, str) else 0


class Formatter:
    """Pre-encoded pieces of one response, so a streamed token costs a few bytes joins."""

    def __init__(self, req: GenRequest, response_id: str, created: int) -> None:
        self.req = req
        self.id = response_id
        self.created = created
        self.object = b"chat.completion.chunk" if req.chat else b"text_completion"
        head = orjson.dumps(
            {"id": response_id, "object": self.object.decode(), "created": created, "model": req.model}
        )[:-1]
        self._head = b"data: " + head + b',"choices":[{"index":0,'

    def chunk(self, index: int, finish_reason: str | None, timing: tuple[int, float] | None = None) -> bytes:
        """The SSE event of generated token `index` (the last one carries the finish reason)."""
        fr = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        text = token_json(index + self.req.first_token_index)
        if self.req.chat:
            out = (
                self._head
                + b'"delta":{"content":'
                + text
                + b'},"logprobs":null,"finish_reason":'
                + fr
                + b',"stop_reason":null}]'
            )
            if index == 0:  # vLLM opens a chat stream with the assistant role
                out = (
                    self._head
                    + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
                    + out
                )
        else:
            out = self._head + b'"text":' + text + b',"logprobs":null,"finish_reason":' + fr + b',"stop_reason":null}]'
        if timing is not None:  # debug: the step that produced the token and its deadline
            out += b',"emu_step":%d,"emu_deadline":%r' % (timing[0], timing[1])
        return out + b"}\n\n"

    def tail(self, completion_tokens: int) -> bytes:
        """What follows the last token: the usage event (if asked for) and [DONE]."""
        if not self.req.include_usage:
            return b"data: [DONE]\n\n"
        usage = orjson.dumps(
            {
                "id": self.id,
                "object": self.object.decode(),
                "created": self.created,
                "model": self.req.model,
                "choices": [],
                "usage": self.usage(completion_tokens),
            }
        )
        return b"data: " + usage + b"\n\ndata: [DONE]\n\n"

    cached_tokens: int | None = None
    """Prompt tokens served from a cache; with `details` on, usage reports them as vLLM's
    --enable-prompt-tokens-details does (prompt_tokens_details.cached_tokens)."""
    created_cache_tokens: int | None = None
    """Chat only: prompt tokens computed and written to the prefix cache."""
    details: bool = False

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        p = self.req.prompt_tokens
        details = None
        if self.details and (self.cached_tokens is not None or self.created_cache_tokens is not None):
            details = {
                "cached_tokens": self.cached_tokens,
                "created_cache_tokens": self.created_cache_tokens if self.req.chat else None,
                "multimodal_tokens": None,
            }
        return {
            "prompt_tokens": p,
            "total_tokens": p + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": details,
        }

    def full(
        self, text: str, finish_reason: str, completion_tokens: int, kv_transfer_params: dict[str, Any] | None
    ) -> bytes:
        """A non-streaming response body."""
        if self.req.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning": None,
            }
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            obj = "text_completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.usage(completion_tokens),
        }
        if self.req.chat:
            out.update(prompt_logprobs=None, prompt_token_ids=None)
        out["kv_transfer_params"] = kv_transfer_params
        return orjson.dumps(out)

    def stream_error(self, status: int, message: str) -> bytes:
        """An error inside a stream that already answered 200 (vLLM sends it as an event)."""
        return b"data: " + ErrorAnswer(status, message).body() + b"\n\ndata: [DONE]\n\n"
