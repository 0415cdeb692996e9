"""Live migration of a running sequence between emulated decode instances, the way Llumnix does it
on vLLM: the KV is copied in stages while the source keeps decoding, and the sequence stops only
for the last few blocks.

Source (`migrate_out`, behind `POST /admin/migrate`): stage k sends the KV tokens computed since
stage k−1 to the target's `POST /kv/migrate`, which reserves blocks for them and answers after the
profile's KV-transfer time. When what is left fits in `stall_blocks` blocks (or at the last
allowed stage) the source freezes the sequence, sends the rest plus the sequence's state, and the
target parks it for the gateway. The source's stream then ends with one event
`{"sibyl_migrated": {...}}` (no [DONE]); the gateway re-attaches the client's stream with a
decode request carrying `kv_transfer_params = {"sibyl_resume": <request id>}`, and the target
continues the sequence from the next token. A refusal (no KV room on the target) or a stage that
fails gives the migration up: the reservation is dropped and the source decodes on.
Real vLLM has no such operation; its backend declares no migration capability.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from adapters.emulator.engine import Engine
from adapters.emulator.host import InstanceHost
from adapters.emulator.sequence import Sequence

PARK_S = 30.0
"""How long a migrated-in sequence waits for the gateway to re-attach before its blocks are freed."""


class MigrateRequest(BaseModel):
    """Body of `POST /admin/migrate` on the source instance."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(description="the X-Request-Id the sequence arrived with")
    target: str = Field(description="the target instance's base URL (http://host:port)")
    max_stages: int = Field(
        4, ge=1, le=32, description="give up when the copy has not converged after this many stages"
    )
    stall_blocks: int = Field(2, ge=1, description="freeze the sequence when at most this many blocks are left to copy")


class MigrationFailed(Exception):
    """The migration was given up; the sequence keeps decoding on the source."""


@dataclass
class MigrationReport:
    request_id: str
    stages: int
    tokens: int
    """KV tokens copied in all."""
    frozen_s: float
    """From freezing the sequence on the source until the target parked it."""
    generated: int
    """Tokens the source had generated when it handed over."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "request_id": self.request_id,
            "stages": self.stages,
            "tokens": self.tokens,
            "frozen_ms": round(self.frozen_s * 1000, 3),
            "generated": self.generated,
        }


async def migrate_out(inst: InstanceHost, m: MigrateRequest) -> MigrationReport:
    """Move the running sequence `m.request_id` to `m.target` (source side; see the module doc)."""
    engine = inst.engine
    if not isinstance(engine, Engine):
        raise MigrationFailed("this instance's scheduler cannot migrate sequences")
    seq = next((s for s in engine.running if s.id == m.request_id and not s.finished), None)
    if seq is None or seq.prefilling or seq.frozen:
        raise MigrationFailed(f"no decoding sequence {m.request_id!r} here")
    url = m.target.rstrip("/") + "/kv/migrate"
    stall_tokens = m.stall_blocks * engine.block_size
    sent = 0
    stage = 0
    frozen_at: float | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            while True:
                stage += 1
                left = seq.computed - sent
                final = left <= stall_tokens or stage >= m.max_stages
                if final:
                    frozen_at = time.monotonic()
                    await engine.freeze(seq)
                    if seq.finished:
                        raise MigrationFailed(f"{m.request_id} finished before the last stage")
                    left = seq.computed - sent
                body: dict[str, Any] = {
                    "request_id": m.request_id,
                    "stage": stage,
                    "tokens": left,
                    "total": sent + left,
                    "final": final,
                }
                if final:
                    body["sequence"] = {
                        "prompt_tokens": seq.prompt_tokens,
                        "max_tokens": seq.max_tokens,
                        "stop_early": seq.stop_early,
                        "priority": seq.priority,
                        "generated": seq.generated,
                        "max_tokens_param": seq.max_tokens_param,
                        "lora": seq.lora,
                    }
                async with http.post(url, data=orjson.dumps(body), headers={"content-type": "application/json"}) as r:
                    answer = await r.read()
                    if r.status != 200:
                        raise MigrationFailed(
                            f"target refused stage {stage}: {r.status} {answer[:200].decode(errors='replace')}"
                        )
                sent += left
                if final:
                    break
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        await _abort(m)
        engine.thaw(seq)
        raise MigrationFailed(f"stage {stage} to {m.target} failed: {type(e).__name__}: {e}") from None
    except MigrationFailed:
        await _abort(m)
        engine.thaw(seq)
        raise
    assert frozen_at is not None
    report = MigrationReport(m.request_id, stage, sent, time.monotonic() - frozen_at, seq.generated)
    seq.handoff = orjson.dumps(
        {"sibyl_migrated": {"target": m.target, "request_id": m.request_id, "generated": seq.generated}}
    )
    engine.migrated_away(seq)
    return report


async def _abort(m: MigrateRequest) -> None:
    """Tell the target to drop what it reserved (best effort: it also expires on its own)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            await http.post(
                m.target.rstrip("/") + "/kv/migrate",
                data=orjson.dumps({"request_id": m.request_id, "abort": True}),
                headers={"content-type": "application/json"},
            )
    except (aiohttp.ClientError, TimeoutError, OSError):
        pass


@dataclass
class _Incoming:
    blocks: int
    tokens: int
    parked: Sequence | None = None
    timer: asyncio.TimerHandle | None = None


class MigrationsIn:
    """The target side: reservations per request, the stages' transfer time, parked sequences."""

    def __init__(self, inst: InstanceHost) -> None:
        self.inst = inst
        self.incoming: dict[str, _Incoming] = {}
        self.waiting: dict[str, asyncio.Future[Sequence]] = {}
        """Resume requests that arrived before the last stage (the gateway opens them early)."""

    async def stage(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One stage (or an abort); returns the HTTP status and answer."""
        rid = str(body.get("request_id"))
        engine = self.inst.engine
        if not isinstance(engine, Engine):
            return 409, {"error": "this instance's scheduler cannot take migrated sequences"}
        if body.get("abort"):
            self._drop(rid)
            return 200, {"aborted": rid}
        tokens, total = int(body.get("tokens", 0)), int(body.get("total", 0))
        cur = self.incoming.get(rid)
        if cur is None:
            cur = self.incoming[rid] = _Incoming(0, 0)
        need = engine.blocks_for(total + 1) - cur.blocks  # room for the next token's KV too
        if need > 0 and not engine.reserve(need, owner=rid):
            self._drop(rid)
            return 409, {"error": f"no KV room for {total} tokens ({need} more blocks, {engine.free_blocks} free)"}
        cur.blocks += max(need, 0)
        await asyncio.sleep(self.inst.s.profile.kv_transfer_time(tokens) * self.inst.faults.slowdown)
        cur.tokens = total
        if not body.get("final"):
            return 200, {"stage": body.get("stage"), "tokens": total}
        state = body.get("sequence") or {}
        seq = Sequence(
            rid,
            int(state["prompt_tokens"]),
            int(state["max_tokens"]),
            stop_early=bool(state.get("stop_early")),
            priority=int(state.get("priority", 0)),
            arrival=time.monotonic(),
            max_tokens_param=int(state.get("max_tokens_param", 0)),
        )
        lora = state.get("lora")
        if isinstance(lora, str) and lora:  # it keeps running under its adapter (pinned here when admitted)
            registered = self.inst.lora.registered.get(lora)
            seq.lora, seq.lora_int_id = lora, registered.int_id if registered is not None else 0
        seq.generated = int(state["generated"])
        seq.computed = total
        seq.prefilling = False
        seq.resumed = True
        engine.kv.adopt(rid, seq)  # the reserved blocks become the sequence's
        waiter = self.waiting.pop(rid, None)
        if waiter is not None and not waiter.done():
            del self.incoming[rid]
            waiter.set_result(seq)  # the gateway is attached already: it decodes from the next step
            return 200, {"resumed": rid, "tokens": total, "generated": seq.generated}
        cur.parked = seq
        cur.timer = asyncio.get_running_loop().call_later(PARK_S, self._drop, rid)
        return 200, {"parked": rid, "tokens": total, "generated": seq.generated}

    async def wait(self, rid: str, timeout_s: float = PARK_S) -> Sequence | None:
        """The sequence `rid` once its last stage arrives (at once if parked); None after the timeout."""
        seq = self.take(rid)
        if seq is not None:
            return seq
        fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None
        finally:
            if self.waiting.get(rid) is fut:
                del self.waiting[rid]

    def take(self, rid: str) -> Sequence | None:
        """The parked sequence for the gateway's resume request (its blocks go with it)."""
        cur = self.incoming.get(rid)
        if cur is None or cur.parked is None:
            return None
        del self.incoming[rid]
        if cur.timer is not None:
            cur.timer.cancel()
        return cur.parked

    def _drop(self, rid: str) -> None:
        cur = self.incoming.pop(rid, None)
        if cur is not None:
            if cur.timer is not None:
                cur.timer.cancel()
            if isinstance(self.inst.engine, Engine):
                if cur.parked is not None:  # it had adopted the reservation
                    self.inst.engine.kv.free(cur.parked)
                    self.inst.engine.kick()
                else:
                    self.inst.engine.unreserve(cur.blocks, owner=rid)
