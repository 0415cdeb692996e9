"""One emulated vLLM instance as a raw ASGI app: OpenAI API, P/D legs, metrics, admin endpoints."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from adapters.emulator.engine import Engine, EngineLike, Sequence
from adapters.emulator.kv import KVHolder, KVPuller, PullFailed
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.protocol import ApiError, Formatter, GenRequest, error_body, parse_request
from adapters.emulator.settings import InstanceSettings, OutputLengths
from adapters.emulator.tokens import token_text

VERSION = "0.32.0"
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def _read(receive: Any) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class EmulatedInstance:
    """Engine + metrics + KV side channel behind vLLM's HTTP surface."""

    def __init__(self, s: InstanceSettings, engine: EngineLike | None = None) -> None:
        self.s = s
        self.faults = s.faults
        self.engine: EngineLike = engine or Engine(
            s.profile, s.faults, max_num_seqs=s.max_num_seqs, kv_capacity_tokens=s.kv_capacity_tokens,
            priority_scheduling=s.scheduling_policy == "priority",
        )
        self.metrics = EngineMetrics(s.model, self.engine)
        self.engine.on_step = self.metrics.step
        self.holder = KVHolder(s.kv_lease_s)
        self.puller = KVPuller(s.kv_handshake_timeout_s)
        self.lengths = OutputLengths(s.output_len_dist, s.seed)
        self.rng = random.Random(s.seed + 1)
        self.engine_id = str(uuid.uuid4())
        self.in_flight = 0
        self.created = int(time.time())
        self._expiry: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.engine.start()
        self._expiry = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        await self.engine.stop()
        await self.puller.close()

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.5, self.s.kv_lease_s / 4))
            for held in self.holder.expire(loop.time()):
                self.engine.release_held(held.blocks)
                self.metrics.expired_kv.inc()

    # --- routing ----------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        path, method = scope["path"], scope["method"]
        headers = dict(scope.get("headers") or [])
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(path.endswith("chat/completions"), headers, receive, send)
        if method == "POST" and path == "/kv/pull":
            return await self._serve_pull(receive, send)
        if path.startswith("/admin/"):
            return await self._admin(path, method, headers, receive, send)
        if method == "GET" and path == "/health":
            return await _send(send, 503 if self.faults.unhealthy else 200, b"")
        if path == "/ping":
            return await _send(send, 200, b"")
        if method == "GET" and path == "/metrics":
            return await _send(send, 200, generate_latest(self.metrics.registry), [(b"content-type", CONTENT_TYPE_LATEST.encode())])
        if method == "GET" and path == "/version":
            return await _send(send, 200, orjson.dumps({"version": VERSION}))
        if method == "GET" and path == "/load":
            return await _send(send, 200, orjson.dumps({"server_load": self.in_flight}))
        if method == "GET" and path == "/v1/models":
            m = {"id": self.s.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.s.model, "parent": None, "max_model_len": self.s.profile.max_model_len, "permission": []}
            return await _send(send, 200, orjson.dumps({"object": "list", "data": [m]}))
        await _send(send, 404, orjson.dumps({"detail": "Not Found"}))

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- generation ---------------------------------------------------------------------------------
    async def _generate(self, chat: bool, headers: dict[bytes, bytes], receive: Any, send: Any) -> None:
        raw = await _read(receive)
        if self.faults.hang:
            await asyncio.Event().wait()
        if self.faults.should_fail(self.rng):
            return await _send(send, self.faults.fail_status, error_body(self.faults.fail_status, "injected failure"))
        try:
            req = parse_request(raw, chat=chat, served_model=self.s.model, max_model_len=self.s.profile.max_model_len)
        except ApiError as e:
            return await _send(send, e.status, e.body())
        xid = (headers.get(b"x-request-id") or uuid.uuid4().hex.encode()).decode()
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        kv = req.kv_transfer_params or {}
        seq = self._sequence(req, xid, arrival)
        external = 0
        if kv.get("do_remote_prefill"):
            try:
                external = await self.puller.pull(kv)
                seq.needs_prefill = False
            except PullFailed:
                self.metrics.failed_transfers.inc()
                policy = kv.get("kv_load_failure_policy") or self.s.kv_load_failure_policy
                if policy != "recompute":
                    self.metrics.success("error")
                    return await _send(send, 500, error_body(500, "Internal server error"))
        timing = headers.get(b"x-emulator-timing") == b"1"
        if timing:
            seq.step_deadlines = []
        self.in_flight += 1
        try:
            self.engine.submit(seq)
            fmt = Formatter(req, f"{xid}-0-{self.engine_id[:8]}" if kv.get("do_remote_decode") else xid, self.created)
            if req.stream and not kv.get("do_remote_decode"):
                await self._stream(seq, req, fmt, send, loop, timing)
            else:
                await seq.done.wait()
                params = self._held_params(seq, fmt, xid) if kv.get("do_remote_decode") else None
                text = "".join(token_text(i) for i in range(seq.generated))
                await _send(send, 200, fmt.full(text, seq.finish_reason, seq.generated, params), [*JSON, (b"x-request-id", xid.encode())])
        finally:
            self.in_flight -= 1
            self._account(seq, req, arrival, external)

    def _sequence(self, req: GenRequest, xid: str, arrival: float) -> Sequence:
        kv = req.kv_transfer_params or {}
        if kv.get("do_remote_decode"):
            return Sequence(xid, req.prompt_tokens, 1, priority=req.priority, arrival=arrival, prefill_only=True, hold_kv=True)
        n, early = req.max_tokens, False
        if not req.ignore_eos:
            drawn = max(req.min_tokens, self.lengths.draw())
            if drawn < req.max_tokens:
                n, early = drawn, True
        return Sequence(xid, req.prompt_tokens, n, stop_early=early, priority=req.priority, arrival=arrival)

    def _held_params(self, seq: Sequence, fmt: Formatter, xid: str) -> dict[str, Any]:
        loop_now = asyncio.get_running_loop().time()
        held = self.holder.hold(fmt.id, seq.blocks, seq.prompt_tokens, loop_now)
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [held.block_ids],
            "remote_engine_id": self.engine_id, "remote_request_id": fmt.id, "remote_host": self.s.host,
            "remote_port": self.s.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": seq.prompt_tokens,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
        }

    async def _stream(self, seq: Sequence, req: GenRequest, fmt: Formatter, send: Any, loop: asyncio.AbstractEventLoop, timing: bool) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE, (b"x-request-id", seq.id.encode())]})
        sent = 0
        offset = time.time() - loop.time()
        while True:
            n = await seq.tokens.get()
            if n < 0:
                break
            out = []
            while sent < n:
                piece = fmt.chunk(token_text(sent), None, first=sent == 0)
                if timing and seq.step_deadlines:
                    piece = piece[:-3] + b',"emu_deadline":' + str(seq.step_deadlines[sent] + offset).encode() + b"}\n\n"
                out.append(piece)
                sent += 1
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        while not seq.tokens.empty():
            seq.tokens.get_nowait()
        tail = [fmt.chunk("", seq.finish_reason)]
        if req.include_usage:
            tail.append(fmt.usage_chunk(seq.generated))
        tail.append(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})

    def _account(self, seq: Sequence, req: GenRequest, arrival: float, external: int) -> None:
        if not seq.done.is_set() or seq.first_token_at is None:
            return
        m = self.metrics
        m.prompt_tokens.inc(req.prompt_tokens)
        if external:
            m.prompt_external.inc(external)
        m.prompt_local.inc(seq.prefilled_tokens)
        m.success(seq.finish_reason)
        m.finished(seq, arrival)

    # --- P/D side channel -------------------------------------------------------------------------------
    async def _serve_pull(self, receive: Any, send: Any) -> None:
        try:
            body = orjson.loads(await _read(receive))
        except orjson.JSONDecodeError:
            return await _send(send, 400, orjson.dumps({"error": "bad pull request"}))
        if body.get("remote_engine_id") != self.engine_id:
            return await _send(send, 404, orjson.dumps({"error": "unknown engine"}))
        held = self.holder.take(str(body.get("remote_request_id")))
        if held is None:
            return await _send(send, 410, orjson.dumps({"error": "blocks expired or unknown request"}))
        await asyncio.sleep(self.s.profile.kv_transfer_time(held.tokens) * self.faults.slowdown)
        self.engine.release_held(held.blocks)
        await _send(send, 200, orjson.dumps({"tokens": held.tokens}))

    # --- admin ------------------------------------------------------------------------------------------
    async def _admin(self, path: str, method: str, headers: dict[bytes, bytes], receive: Any, send: Any) -> None:
        if self.s.admin_token and headers.get(b"authorization", b"").decode() != f"Bearer {self.s.admin_token}":
            return await _send(send, 401, error_body(401, "admin endpoints need the --admin-token bearer token"))
        if path == "/admin/faults" and method == "GET":
            return await _send(send, 200, self.faults.model_dump_json().encode())
        if path == "/admin/faults" and method == "PUT":
            try:
                update = orjson.loads(await _read(receive))
                for k, v in update.items():
                    setattr(self.faults, k, v)
            except (orjson.JSONDecodeError, AttributeError, ValueError, ValidationError) as e:
                return await _send(send, 400, error_body(400, f"bad faults: {e}"))
            self.engine.wake()
            return await _send(send, 200, self.faults.model_dump_json().encode())
        if path == "/admin/exit" and method == "POST":
            await _send(send, 200, b'{"exiting": true}')
            asyncio.get_running_loop().call_later(0.05, os._exit, 3)
            return None
        return await _send(send, 404, orjson.dumps({"detail": "Not Found"}))
