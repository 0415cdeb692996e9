"""One emulated vLLM instance as an ASGI app: OpenAI API, P/D legs, KV side channel, metrics, admin.

A raw ASGI app rather than Starlette routes: the streaming path writes tokens from the engine
task (see asgi.py), and nothing else here needs a framework. Routes:

  POST /v1/completions, /v1/chat/completions   generation (vLLM 0.32 shapes, SSE when stream)
  GET  /v1/models /health /ping /version /load /metrics, POST /tokenize /ping   (info_api.py)
  POST /kv/pull                                 P/D side channel (kv_legs.py, kv.py)
  POST /reset_prefix_cache                      drop the prefix cache (vLLM serves it in dev mode)
  POST /v1/load_lora_adapter /v1/unload_lora_adapter   with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING
                                                (lora.py); a request's `model` may name a loaded adapter
  /admin/*                                      faults, exit, info, step log (admin.py)
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from adapters.emulator.admin import AdminApi
from adapters.emulator.asgi import (
    JSON,
    SSE,
    DirectSink,
    Flusher,
    QueueSink,
    Receive,
    Scope,
    Send,
    direct_transport,
    read_body,
    respond_with_length,
    watch_disconnect,
)
from adapters.emulator.dp_group import DataParallelGroup
from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.faults import Faults
from adapters.emulator.host_board import HostBoard, InstanceStreaming
from adapters.emulator.info_api import InfoApi
from adapters.emulator.kv import PullFailed
from adapters.emulator.kv_legs import KVLegs
from adapters.emulator.kv_publisher import KVEventPublisher
from adapters.emulator.lora import EmulatedLora
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.migration import PARK_S, MigrationsIn
from adapters.emulator.protocol import ErrorAnswer, Formatter, GenRequest, parse_request
from adapters.emulator.sequence import Scheduler
from adapters.emulator.settings import InstanceSettings, OutputLengths
from adapters.emulator.tokens import (
    OWN_TOKEN_BASE,
    output_text,
)

if TYPE_CHECKING:
    from adapters.emulator.tracing import EngineTracing

INTERNAL = ErrorAnswer(500, "Internal server error")
NOT_FOUND = orjson.dumps({"detail": "Not Found"})

SchedulerFactory = Callable[[InstanceSettings, Faults], Scheduler]
"""Builds an instance's scheduler from its settings and fault state."""


def continuous_batching(s: InstanceSettings, faults: Faults) -> Scheduler:
    """The emulator's own scheduler: vLLM-style continuous batching (engine.py), or a data-parallel
    group of such engines stepping together (dp_group.py)."""
    args = {
        "max_num_seqs": s.max_num_seqs,
        "kv_capacity_tokens": s.kv_tokens,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "priority_scheduling": s.scheduling_policy == "priority",
        "block_size": s.kv_block_size,
        "enable_prefix_caching": s.enable_prefix_caching,
        "kv_events": s.kv_events.active,
    }
    if s.data_parallel_size > 1:
        return DataParallelGroup(s.data_parallel_size, s.profile, faults, **args)
    return Engine(s.profile, faults, **args)  # type: ignore[arg-type]


class EmulatedInstance:
    """Engine + metrics + KV side channel behind vLLM's HTTP surface; its parts (admin, info, KV legs,
    migrations) see it as a `host.InstanceHost`."""

    def __init__(self, s: InstanceSettings, scheduler: SchedulerFactory | None = None) -> None:
        self.s = s
        self.context_len = s.context_len
        self.faults = Faults(s.faults, seed=s.seed + 1)
        self.engine: Scheduler = (scheduler or continuous_batching)(s, self.faults)
        self.caching = s.enable_prefix_caching and bool(self.engines())
        """Prefix caching runs (the scheduler is the emulator's own and it is on): prompts need token ids."""
        self.metrics = EngineMetrics(s.model, self.engine, self.context_len, prefix_caching=self.caching)
        self.publishers: list[KVEventPublisher] = []
        self.lora = EmulatedLora(
            s.lora,
            s.model,
            s.profile.lora_load_s,
            s.profile.lora_per_adapter_step_s,
            stall=self._stall,
            clock=self.engine.clock,
            registry=self.metrics.registry,
        )
        """Its LoRA adapters (adapters/emulator/lora.py); inert unless --enable-lora."""
        if s.lora.enable_lora:
            for engine in self.engines():
                engine.lora = self.lora
        self.streaming = InstanceStreaming(HostBoard(Path(s.host_board)), s.host_slot) if s.host_board else None
        """Its place on the host board (adapters/emulator/host_board.py): what it streams, what the host does."""
        if self.streaming is not None:
            self.streaming.attach(self.engine, self.engines())
        self.flusher = Flusher(s.writer_threads)
        self.engine.flush = self.flusher
        self.pd = KVLegs(self)
        """Its legs of the P/D KV handoff: holding and serving pulls (prefill), pulling (decode)."""
        self.lengths = OutputLengths(s.output_len_dist, s.seed)
        self.engine_id = str(uuid.uuid4())
        self.in_flight = 0
        self.created = int(time.time())
        self.admin = AdminApi(self, self.pd.holder)
        self.info = InfoApi(self)
        self.migrations = MigrationsIn(self)
        self.tracing: EngineTracing | None = None
        """vLLM's `llm_request` span per request, with --otlp-traces-endpoint (adapters/emulator/tracing.py)."""
        self._routes: dict[tuple[str, str], Any] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/kv/pull"): self.pd.serve_pull,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/kv/migrate"): self._serve_migrate,
            ("GET", "/health"): self.info.health,
            ("GET", "/ping"): self.info.health,
            ("POST", "/ping"): self.info.health,
            ("GET", "/metrics"): self.info.metrics,
            ("GET", "/version"): self.info.version,
            ("GET", "/load"): self.info.load,
            ("GET", "/v1/models"): self.info.models,
            ("POST", "/tokenize"): self.info.tokenize,
            **self.lora.routes(),
        }

    # --- lifecycle ------------------------------------------------------------------------------
    def engines(self) -> list[Engine]:
        """The engines whose block pools this instance has (a data-parallel group's ranks; none for
        other schedulers)."""
        if isinstance(self.engine, Engine):
            return [self.engine]
        if isinstance(self.engine, DataParallelGroup):
            return list(self.engine.ranks)
        return []

    def _stall(self, seconds: float) -> None:
        """A LoRA load: the instance's engines take no step for `seconds` from now (vLLM's engine core
        runs add_lora between steps)."""
        for engine in self.engines():
            engine.stall(seconds)

    async def start(self) -> None:
        if self.s.kv_events.active:
            for rank, engine in enumerate(self.engines()):
                pub = KVEventPublisher(self.s.kv_events.for_rank(rank), data_parallel_rank=rank)
                pub.start()
                engine.kv.on_events = pub.publish
                self.publishers.append(pub)
        if self.s.otlp_traces_endpoint:
            from adapters.emulator.tracing import EngineTracing  # opentelemetry loads only when tracing is on

            service = f"{self.s.role}-{self.s.port}"
            self.tracing = EngineTracing(
                self.s.otlp_traces_endpoint, self.s.otlp_traces_protocol, model=self.s.model, service_name=service
            )
        self.engine.start()
        self.pd.holder.start()
        self.faults.arm()
        s = self.s
        clamp = (
            f" (cut to the KV capacity from {s.max_model_len or s.profile.max_model_len})"
            if self.context_len < (s.max_model_len or s.profile.max_model_len)
            else ""
        )
        print(
            f"emulate: {s.role} instance on http://{s.host}:{s.port} model {s.model} profile {s.profile.name} "
            f"max_model_len {self.context_len}{clamp} KV blocks {self.engine.total_blocks}x{self.engine.block_size} "
            f"engine {self.engine_id}",
            file=sys.stderr,
            flush=True,
        )

    async def stop(self) -> None:
        await self.pd.holder.stop()
        await self.engine.stop()
        for pub in self.publishers:
            await pub.stop()
        await self.pd.puller.close()
        self.flusher.close()
        if self.streaming is not None:
            self.streaming.stop()
        if self.tracing is not None:
            self.tracing.shutdown()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None
        path: str = scope["path"]
        handler = self._routes.get((scope["method"], path))
        if handler is not None:
            return await handler(scope, receive, send)
        if path.startswith("/admin/"):
            return await self.admin.handle(scope, receive, send)
        if any(p == path for _, p in self._routes):
            return await respond_with_length(send, 405, orjson.dumps({"detail": "Method Not Allowed"}))
        return await respond_with_length(send, 404, NOT_FOUND)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- generation -----------------------------------------------------------------------------
    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        raw = await read_body(receive)
        if self.faults.on_request():
            status = self.faults.config.fail_status
            return await respond_with_length(
                send, status, ErrorAnswer(status, f"injected failure (emulator fault, status {status})").body()
            )
        try:
            req = parse_request(
                raw,
                chat=chat,
                served_model=self.s.model,
                max_model_len=self.context_len,
                want_ids=self.caching,
                adapter_of=self.lora.adapter_of if self.s.lora.enable_lora else None,
            )
        except ErrorAnswer as e:
            return await respond_with_length(send, e.status, e.body())
        headers = dict(scope.get("headers") or [])
        xid = (headers.get(b"x-request-id") or uuid.uuid4().hex.encode()).decode()
        try:
            dp_rank = self._dp_rank(headers.get(b"x-data-parallel-rank"))
        except ErrorAnswer as e:
            return await respond_with_length(send, e.status, e.body())
        kv = req.kv_transfer_params or {}
        prefill_leg = bool(kv.get("do_remote_decode"))
        arrival = self.engine.clock()
        if kv.get("sibyl_resume") is not None:
            return await self._resume(scope, receive, send, req, kv, xid, chat, headers)
        self.in_flight += 1
        seq: Sequence | None = None
        try:
            external = 0
            local = -1
            if kv.get("do_remote_prefill") and not prefill_leg:
                # vLLM's scheduler looks up the local prefix cache first; NIXL pulls only the rest
                local = self.pd.local_hit(req)
                pull = asyncio.ensure_future(self.pd.pull(req, kv, local))

                def client_left() -> None:  # vLLM aborts a request whose client left
                    pull.cancel()

                watch = watch_disconnect(receive, client_left)
                try:
                    external = await pull
                except PullFailed:
                    return await respond_with_length(send, 500, INTERNAL.body())
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if me is not None and me.cancelling():
                        raise
                    return None  # the client left while its KV was being pulled
                finally:
                    watch.cancel()
            seq = self._sequence(req, xid, arrival, prefill_leg, external)
            seq.dp_rank = dp_rank
            if external:
                seq.cached_tokens = max(local, 0)
            fmt = Formatter(req, ("chatcmpl-" if chat else "cmpl-") + xid, self.created)
            fmt.details = self.s.enable_prompt_tokens_details
            if kv.get("do_remote_prefill") and isinstance(kv.get("remote_prefill_cached_tokens"), int):
                fmt.cached_tokens = kv["remote_prefill_cached_tokens"]  # vLLM reports P's hits on D
            if req.stream and not prefill_leg:
                await self._stream(scope, receive, send, seq, fmt, headers.get(b"x-emulator-timing") == b"1")
            else:
                await self._whole(receive, send, seq, fmt, chat, prefill_leg)
        finally:
            self.in_flight -= 1
            if self.tracing is not None and seq is not None:
                self.tracing.finished(headers, ("chatcmpl-" if chat else "cmpl-") + xid, seq)

    async def _resume(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        req: GenRequest,
        kv: dict[str, Any],
        xid: str,
        chat: bool,
        headers: dict[bytes, bytes],
    ) -> None:
        """The gateway re-attaches a stream to a sequence migrated here (adapters/emulator/migration.py);
        it may come before the last stage and waits for it (`wait_s`, at most the parking time)."""
        rid = str(kv["sibyl_resume"])
        try:
            wait_s = min(max(float(kv.get("wait_s", PARK_S)), 0.0), PARK_S)
        except (TypeError, ValueError):
            return await respond_with_length(
                send,
                400,
                ErrorAnswer(400, "kv_transfer_params.wait_s must be a number of seconds", "kv_transfer_params").body(),
            )
        if not req.stream:
            return await respond_with_length(
                send, 400, ErrorAnswer(400, "a migrated sequence resumes as a stream only", "stream").body()
            )
        waiting = asyncio.ensure_future(
            self.migrations.wait(rid, wait_s)
        )  # the gateway may attach before the last stage

        def client_left() -> None:
            waiting.cancel()

        watch = watch_disconnect(receive, client_left)
        try:
            seq = await waiting
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            return None  # the gateway gave the migration up
        finally:
            watch.cancel()
        if seq is None:
            return await respond_with_length(
                send, 404, ErrorAnswer(404, f"no migrated sequence {rid!r} arrived here", "kv_transfer_params").body()
            )
        seq.id = xid
        self.in_flight += 1
        try:
            fmt = Formatter(req, ("chatcmpl-" if chat else "cmpl-") + xid, self.created)
            await self._stream(scope, receive, send, seq, fmt, headers.get(b"x-emulator-timing") == b"1", resume=True)
        finally:
            self.in_flight -= 1
            if self.tracing is not None:
                self.tracing.finished(headers, ("chatcmpl-" if chat else "cmpl-") + xid, seq)

    async def _serve_migrate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Target side of a migration stage (adapters/emulator/migration.py)."""
        try:
            body = orjson.loads(await read_body(receive))
        except orjson.JSONDecodeError:
            return await respond_with_length(send, 400, orjson.dumps({"error": "bad migration stage"}))
        if not isinstance(body, dict) or "request_id" not in body:
            return await respond_with_length(
                send, 400, orjson.dumps({"error": "a migration stage names its request_id"})
            )
        status, answer = await self.migrations.stage(body)
        await respond_with_length(send, status, orjson.dumps(answer))

    def _dp_rank(self, raw: bytes | None) -> int:
        """The rank vLLM's X-data-parallel-rank header asks for (-1: none); out of range is a 400."""
        if raw is None:
            return -1
        size = self.s.data_parallel_size
        try:
            rank = int(raw)
        except ValueError:
            rank = -1
        if not 0 <= rank < size:
            raise ErrorAnswer(
                400,
                f"data_parallel_rank {raw.decode(errors='replace')} is out of range [0, {size})",
                "X-data-parallel-rank",
            )
        return rank

    def _sequence(self, req: GenRequest, xid: str, arrival: float, prefill_leg: bool, external: int) -> Sequence:
        common: dict[str, Any] = {
            "priority": req.priority,
            "arrival": arrival,
            "max_tokens_param": req.max_tokens,
            "prompt_ids": req.prompt_ids,
            "output_base": OWN_TOKEN_BASE + req.first_token_index,
        }
        if req.lora is not None:
            registered = self.lora.registered.get(req.lora)
            common["lora"] = req.lora
            common["lora_int_id"] = registered.int_id if registered is not None else 0
        if prefill_leg:  # vLLM's P leg: prefill, one token, keep the KV for the decode instance
            return Sequence(xid, req.prompt_tokens, 1, prefill_only=True, hold_kv=True, **common)
        n, early = req.max_tokens, False
        if not req.ignore_eos:
            drawn = max(req.min_tokens, self.lengths.draw(req.seed))
            if drawn < n:
                n, early = drawn, True
        return Sequence(xid, req.prompt_tokens, n, stop_early=early, external_tokens=external, **common)

    async def _stream(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        seq: Sequence,
        fmt: Formatter,
        timing: bool,
        resume: bool = False,
    ) -> None:
        chunked = scope.get("http_version") != "1.0"
        head = [*SSE, (b"x-request-id", seq.id.encode())] + ([(b"transfer-encoding", b"chunked")] if chunked else [])
        await send({"type": "http.response.start", "status": 200, "headers": head})
        transport = direct_transport(send) if chunked else None
        sink: DirectSink | QueueSink = (
            DirectSink(fmt, transport, timing) if transport is not None else QueueSink(fmt, timing)
        )
        seq.sink = sink
        watch = watch_disconnect(receive, lambda: self.engine.abort(seq))
        if resume and isinstance(self.engine, Engine):
            self.engine.resume(seq)
        else:
            self.engine.submit(seq)
        try:
            if isinstance(sink, QueueSink):
                while (event := await sink.queue.get()) is not None:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            else:
                await seq.done.wait()
        finally:
            watch.cancel()
            self.engine.abort(seq)  # no-op when it finished; frees its slot if this task failed or was cancelled
        if seq.finish_reason in ("stop", "length"):
            self._cache_usage(fmt, seq)
            tail = fmt.tail(seq.generated)
        elif seq.finish_reason == "error":
            tail = fmt.stream_error(500, "Internal server error")
        elif seq.finish_reason == "migrated" and seq.handoff is not None:
            tail = b"data: " + seq.handoff + b"\n\n"  # where it went; the gateway re-attaches there
        else:
            tail = b""  # aborted: the client is gone
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _whole(
        self, receive: Receive, send: Send, seq: Sequence, fmt: Formatter, chat: bool, prefill_leg: bool
    ) -> None:
        watch = watch_disconnect(receive, lambda: self.engine.abort(seq))
        self.engine.submit(seq)
        try:
            await seq.done.wait()
        finally:
            watch.cancel()
            self.engine.abort(seq)  # no-op when it finished
        if seq.finish_reason == "abort":
            return None
        if seq.finish_reason not in ("stop", "length"):
            return await respond_with_length(send, 500, INTERNAL.body())
        params = self.pd.hold(seq, chat) if prefill_leg else None
        self._cache_usage(fmt, seq)
        body = fmt.full(
            output_text(seq.generated, fmt.req.first_token_index), seq.finish_reason or "length", seq.generated, params
        )
        await respond_with_length(send, 200, body, [*JSON, (b"x-request-id", seq.id.encode())])

    def _cache_usage(self, fmt: Formatter, seq: Sequence) -> None:
        """usage.prompt_tokens_details as vLLM fills it: cached tokens (on a decode leg, the prefill
        side's, already set), and for chat the full prompt blocks written to the cache."""
        if not fmt.details or seq.cached_tokens < 0:
            return
        if fmt.cached_tokens is None:
            fmt.cached_tokens = seq.cached_tokens + seq.external_tokens
        bs = self.s.kv_block_size
        fmt.created_cache_tokens = max(0, seq.prompt_tokens // bs * bs - fmt.cached_tokens)

    async def _reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's POST /reset_prefix_cache: {"success": false} while any block is in use; on success
        every engine publishes AllBlocksCleared at once."""
        await read_body(receive)
        engines = self.engines()
        ok = bool(engines) and all([e.reset_prefix_cache() for e in engines])
        await respond_with_length(send, 200, orjson.dumps({"success": ok}))
