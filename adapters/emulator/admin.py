"""The emulator's own endpoints under /admin/: faults, exit, instance info and the step log.

  GET  /admin/faults          current faults (FaultConfig as JSON)
  PUT  /admin/faults          partial update, e.g. {"fail_rate": 0.5, "fail_status": 429},
                              {"slowdown": 3}, {"hang": true}, {"unhealthy": true},
                              {"exit_after_requests": 10}; 400 (and no change) if invalid
  POST /admin/exit            {"code": 3, "delay_s": 0} (both optional): the whole process exits
                              at once, like a crash (with --instances N, all N go)
  GET  /admin/info            role, engine id, profile, limits, queue and KV state (per rank for a DP group),
                              LoRA adapters registered and resident with the adapter cache's counts
  GET  /admin/steps?since=N   the engine's step log after step N (start/end on time.monotonic())
  POST /admin/migrate         {"request_id", "target", "max_stages", "stall_blocks"}: move a running
                              sequence to another emulated instance (adapters/emulator/migration.py);
                              200 with the stages, tokens copied and the freeze time, or 409 why not

They are served on the instance's own address (127.0.0.1 unless --host says otherwise). With
--admin-token T every /admin/ request needs `Authorization: Bearer T` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any
from urllib.parse import parse_qs

import orjson
from pydantic import ValidationError

from adapters.emulator.asgi import Receive, Scope, Send, read_body, respond_with_length
from adapters.emulator.dp_group import DataParallelGroup
from adapters.emulator.faults import EXIT_CODE, exit_now
from adapters.emulator.host import InstanceHost
from adapters.emulator.kv import KVHolder
from adapters.emulator.migration import MigrateRequest, MigrationFailed, migrate_out
from adapters.emulator.protocol import ErrorAnswer


class AdminApi:
    """Handlers of /admin/* for one instance (`holder`: its prefill leg's held KV, which /admin/info counts)."""

    def __init__(self, inst: InstanceHost, holder: KVHolder) -> None:
        self.inst = inst
        self.holder = holder

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.inst.s.admin_token
        if token:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + token.encode()):
                return await respond_with_length(
                    send, 401, ErrorAnswer(401, "admin endpoints need `Authorization: Bearer <--admin-token>`").body()
                )
        method, path = scope["method"], scope["path"]
        if path == "/admin/faults" and method == "GET":
            return await respond_with_length(send, 200, self.inst.faults.config.model_dump_json().encode())
        if path == "/admin/faults" and method in ("PUT", "POST", "PATCH"):
            return await self._set_faults(receive, send)
        if path == "/admin/exit" and method == "POST":
            return await self._exit(receive, send)
        if path == "/admin/info" and method == "GET":
            return await respond_with_length(send, 200, orjson.dumps(self.info()))
        if path == "/admin/steps" and method == "GET":
            return await self._steps(scope, send)
        if path == "/admin/migrate" and method == "POST":
            return await self._migrate(receive, send)
        return await respond_with_length(send, 404, orjson.dumps({"detail": "Not Found"}))

    async def _set_faults(self, receive: Receive, send: Send) -> None:
        try:
            changes = orjson.loads(await read_body(receive))
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object")
            config = self.inst.faults.update(changes)
        except (orjson.JSONDecodeError, ValueError, ValidationError) as e:
            return await respond_with_length(send, 400, ErrorAnswer(400, f"bad faults: {e}").body())
        self.inst.engine.kick()
        await respond_with_length(send, 200, config.model_dump_json().encode())

    async def _exit(self, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        try:
            opts = orjson.loads(raw) if raw.strip() else {}
            code = int(opts.get("code", EXIT_CODE))
            delay = float(opts.get("delay_s", 0.0))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            return await respond_with_length(send, 400, ErrorAnswer(400, f"bad exit request: {e}").body())
        await respond_with_length(send, 200, orjson.dumps({"exiting": True, "code": code, "delay_s": delay}))
        asyncio.get_running_loop().call_later(max(0.05, delay), exit_now, code)

    async def _migrate(self, receive: Receive, send: Send) -> None:
        try:
            m = MigrateRequest.model_validate_json(await read_body(receive))
        except ValidationError as e:
            return await respond_with_length(send, 400, ErrorAnswer(400, f"bad migration request: {e}").body())
        try:
            report = await migrate_out(self.inst, m)
        except MigrationFailed as e:
            return await respond_with_length(send, 409, orjson.dumps({"ok": False, "error": str(e)}))
        await respond_with_length(send, 200, orjson.dumps(report.as_dict()))

    def info(self) -> dict[str, Any]:
        inst, e, s = self.inst, self.inst.engine, self.inst.s
        return {
            "role": s.role,
            "engine_id": inst.engine_id,
            "model": s.model,
            "profile": s.profile.name,
            "host": s.host,
            "port": s.port,
            "max_model_len": inst.context_len,
            "max_num_seqs": e.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "block_size": e.block_size,
            "total_blocks": e.total_blocks,
            "free_blocks": e.free_blocks,
            "held_blocks": e.held_blocks,
            "held_requests": len(self.holder.table),
            "running": len(e.running),
            "waiting": e.waiting,
            "preemptions": e.preemptions,
            "steps": e.step_no,
            "in_flight": inst.in_flight,
            "scheduling_policy": s.scheduling_policy,
            "kv_load_failure_policy": s.kv_load_failure_policy,
            "faults": inst.faults.config.model_dump(),
            "data_parallel_size": s.data_parallel_size,
            "ranks": [{"running": n, "kv_tokens": kv} for n, kv in e.rank_load()]
            if isinstance(e, DataParallelGroup)
            else None,
            "lora": self._lora() if s.lora.enable_lora else None,
        }

    def _lora(self) -> dict[str, Any]:
        """The adapters: registered, resident (least recently used first) and the cache's counts."""
        lora = self.inst.lora
        c = lora.cache.counters
        return {
            "max_loras": lora.settings.max_loras,
            "max_cpu_loras": lora.settings.capacity,
            "registered": list(lora.registered),
            "resident": lora.cache.loaded(lora.clock()),
            "loads": c.loads,
            "evictions": c.evictions,
            "hits": c.hits,
        }

    async def _steps(self, scope: Scope, send: Send) -> None:
        qs = parse_qs((scope.get("query_string") or b"").decode())
        try:
            since = int(qs.get("since", ["0"])[0])
        except ValueError:
            return await respond_with_length(send, 400, ErrorAnswer(400, "since must be an integer", "since").body())
        rows = [
            [
                r.n,
                r.start,
                r.end,
                r.batch,
                r.kv_tokens,
                r.tokens,
                r.chunks,
                r.sampled,
                r.slowdown,
                r.start_kind,
                r.woke,
                r.released,
            ]
            for r in self.inst.engine.steps
            if r.n > since
        ]
        fields = [
            "n",
            "start",
            "end",
            "batch",
            "kv_tokens",
            "tokens",
            "chunks",
            "sampled",
            "slowdown",
            "start_kind",
            "woke",
            "released",
        ]
        await respond_with_length(send, 200, orjson.dumps({"fields": fields, "steps": rows}))
