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
    _tail: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> int:
        """Consume bytes; return how many new token events completed in them."""
        data = self._tail + chunk if self._tail else chunk
        # Split left to right and keep the unfinished rest: unlike rfind, this cuts "\n\n\n" the
        # same way whether or not a chunk boundary falls inside it.
        events = data.split(b"\n\n")
        self._tail = events.pop()
        before = self.tokens
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
                elif event.startswith(b"data:") and not _EMPTY.search(event):
                    self.tokens += 1
            elif b'"error"' in event:
                self.error = event.decode(errors="replace")[6:]
        return self.tokens - before

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
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.tokens


def completion_tokens(reply: dict[str, Any]) -> int:
    """Output tokens of a non-streaming reply (from `usage`, else 0)."""
    usage = reply.get("usage") or {}
    n = usage.get("completion_tokens")
    return int(n) if isinstance(n, int) else 0


def prompt_tokens(reply: dict[str, Any]) -> int | None:
    usage = reply.get("usage") or {}
    n = usage.get("prompt_tokens")
    return int(n) if isinstance(n, int) else None
