"""vLLM's disaggregated-proxy protocol: the prefill and decode leg bodies, and SSE token counting.

Leg 1 goes to the prefill instance with `kv_transfer_params.do_remote_decode = true`,
`max_tokens = 1`, no streaming; its reply carries the `kv_transfer_params` that leg 2 hands to
the decode instance verbatim with the client's original body (vLLM repo,
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; shared/design/vllm-integration.md A.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_EMPTY = re.compile(rb'"(?:text|content)":\s*""')
"""An event that carries no text: vLLM's opening role chunk of a chat stream, or the finish chunk."""
_QUOTES = re.compile(rb'""')
"""What every `_EMPTY` match ends with: most events hold none, and this search is a fraction of `_EMPTY`'s
(`in` on bytes costs more than either: it first tries the operand as a byte value and clears the TypeError)."""

LEG1_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body rewritten for the prefill-only leg."""
    leg = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    leg["kv_transfer_params"] = dict(LEG1_KV_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def decode_leg_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's original body plus the prefill instance's `kv_transfer_params`."""
    leg = dict(body)
    if kv_transfer_params is not None:
        leg["kv_transfer_params"] = kv_transfer_params
    return leg


HANDOFF_EVENT = b'data: {"sibyl_migrated":'
"""How an emulated decode instance ends the stream of a sequence it migrated away (its JSON says
where: {"sibyl_migrated": {"target", "request_id", "generated"}}); real vLLM never sends it."""


def resume_leg_body(body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The client's body, asking the target of a migration to continue the sequence it parked."""
    return {**body, "stream": True, "kv_transfer_params": {"sibyl_resume": request_id}}


@dataclass
class SSETokenCounter:
    """Counts generated tokens in an OpenAI SSE stream without decoding every event as JSON.

    vLLM sends one `data:` event per generated chunk with a non-empty `choices` list, an optional
    usage event with `"choices":[]` and a final `data: [DONE]`. Events may be split across network
    chunks, so only complete events (ending in a blank line) are inspected.
    """

    tokens: int = 0
    done: bool = False
    error: str | None = None
    usage_completion_tokens: int | None = None
    offset: int = 0
    """Tokens streamed before the current stream took over (a stream resumed elsewhere reports
    usage for its own tokens only)."""
    _tail: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> int:
        """Consume bytes; return how many new token events completed in them."""
        data = self._tail + chunk if self._tail else chunk
        # Split left to right and keep the unfinished rest: unlike rfind, this cuts "\n\n\n" the
        # same way whether or not a chunk boundary falls inside it.
        events = data.split(b"\n\n")
        self._tail = events.pop()
        before = tokens = self.tokens  # counted in a local, stored once
        for event in events:
            if event[:1] == b"\n":
                event = event.lstrip(b"\n")  # blank lines between events carry nothing (SSE)
            if not event:
                continue
            if event.startswith(b"data: [DONE]"):
                self.done = True
                continue
            i = event.find(b'"choices":')
            if i >= 0:
                j = i + 10
                if event[j : j + 1] == b" ":
                    j += 1
                if event[j : j + 2] == b"[]":
                    self._read_usage(event)
                elif event.startswith(b"data:") and not (_QUOTES.search(event) and _EMPTY.search(event)):
                    tokens += 1
            elif b'"error"' in event:
                self.error = event.decode(errors="replace")[6:]
        self.tokens = tokens
        return tokens - before

    def _read_usage(self, event: bytes) -> None:
        import orjson

        try:
            payload = orjson.loads(event[5:]) if event.startswith(b"data:") else None
        except orjson.JSONDecodeError:
            return
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
            self.usage_completion_tokens = usage["completion_tokens"]

    @property
    def output_tokens(self) -> int:
        return self.usage_completion_tokens + self.offset if self.usage_completion_tokens is not None else self.tokens


class StreamTranscript:
    """The text a relayed SSE stream has carried so far, for resuming it elsewhere.

    Relaying stays cheap: chunks are kept by reference and only decoded when they pass
    COMPACT_BYTES (then to text, a few bytes per token) or when the text is asked for.
    """

    COMPACT_BYTES = 64 * 1024

    __slots__ = ("chat", "_chunks", "_size", "_text", "_tail", "resumable")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._chunks: list[bytes] = []
        self._size = 0
        self._text: list[str] = []
        self._tail = b""
        self.resumable: str | None = None
        """Why the stream cannot be continued from its text (tool calls, several choices), if so."""

    def add(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size > self.COMPACT_BYTES:
            self._compact()

    def text(self) -> str:
        self._compact()
        return "".join(self._text)

    def _compact(self) -> None:
        import orjson

        data = self._tail + b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        events = data.split(b"\n\n")
        self._tail = events.pop()
        for event in events:
            event = event.strip(b"\n")
            if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
                continue
            try:
                payload = orjson.loads(event[5:])
            except orjson.JSONDecodeError:
                continue
            choices = payload.get("choices") if isinstance(payload, dict) else None
            if not choices:
                continue
            if len(choices) > 1 or choices[0].get("index", 0) != 0:
                self.resumable = "it streams several choices"
                continue
            part = choices[0].get("delta") if self.chat else choices[0]
            if not isinstance(part, dict):
                continue
            if self.chat and (part.get("tool_calls") or part.get("reasoning_content") or part.get("reasoning")):
                self.resumable = "it streams tool calls or reasoning, which cannot be continued as text"
            text = part.get("content") if self.chat else part.get("text")
            if isinstance(text, str):
                self._text.append(text)


def prompt_is_token_ids(body: dict[str, Any]) -> bool:
    """Whether a completions body's prompt is a list of token ids (a continuation then needs the
    streamed text's ids: the target instance's /tokenize gives them)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def continuation_body(
    body: dict[str, Any], chat: bool, text: str, streamed: int, text_ids: list[int] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """The client's body asking another instance to continue after `text` (`streamed` tokens),
    recomputing prompt + text there; or None and why it cannot be continued.

    Completions append the text to the prompt (a token-id prompt appends `text_ids`, the text
    tokenized by the target); chat appends it as the assistant's message with vLLM's
    `continue_final_message` (and `add_generation_prompt` off). max_tokens (and min_tokens)
    shrink by what was streamed."""
    if body.get("n", 1) not in (None, 1) or body.get("best_of", 1) not in (None, 1):
        return None, "it asks for several choices"
    if body.get("logprobs") or body.get("echo"):
        return None, "it asks for logprobs or echo, which a continuation would not reproduce"
    leg = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None, "its messages are not a list"
        leg["messages"] = [*messages, {"role": "assistant", "content": text}]
        leg["continue_final_message"] = True
        leg["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if prompt_is_token_ids(body):
            if text_ids is None:
                return None, "its prompt is token ids and the streamed text was not tokenized"
            leg["prompt"] = [*body["prompt"], *text_ids]
        elif isinstance(prompt, str):
            leg["prompt"] = prompt + text
        else:
            return None, "its prompt is a batch, which a continuation cannot carry"
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            leg[key] = body[key] - streamed
    for key in ("min_tokens", "min_completion_tokens"):
        if isinstance(body.get(key), int):
            leg[key] = max(0, body[key] - streamed)
    if not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")) and not chat:
        leg["max_tokens"] = 16 - streamed  # vLLM's completions default
    if any(isinstance(leg.get(k), int) and leg[k] < 1 for k in ("max_tokens", "max_completion_tokens")):
        return None, "every token it asked for was streamed already"
    return leg, ""


def add_streamed_usage(chunk: bytes, streamed: int) -> bytes:
    """Rewrite the usage event of a resumed stream so it counts the `streamed` tokens sent before
    as completion tokens, not prompt tokens (they were recomputed as part of the prompt)."""
    import orjson

    events = chunk.split(b"\n\n")
    for k, event in enumerate(events):
        if b'"usage"' not in event or not event.startswith(b"data:"):
            continue
        try:
            payload = orjson.loads(event[5:])
        except orjson.JSONDecodeError:
            continue
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict) or type(usage.get("completion_tokens")) is not int:
            continue
        usage["completion_tokens"] += streamed
        if type(usage.get("prompt_tokens")) is int:
            usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - streamed)
        events[k] = b"data: " + orjson.dumps(payload)
    return b"\n\n".join(events)


def completion_tokens(reply: dict[str, Any]) -> int:
    """Output tokens of a non-streaming reply (from `usage`, else 0)."""
    usage = reply.get("usage") or {}
    n = usage.get("completion_tokens")
    return int(n) if isinstance(n, int) else 0


def prompt_tokens(reply: dict[str, Any]) -> int | None:
    usage = reply.get("usage") or {}
    n = usage.get("prompt_tokens")
    return int(n) if isinstance(n, int) else None
