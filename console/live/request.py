"""LiveRequest: the one object that owns a live request from admission to its outcome.

Its life, each step stamped with the time it was entered:

    admitted → [queued] → prefill (retried once elsewhere) → decode bound → decoding → finished
                                                                             (→ moved) ↘ failed

"Moved" is a migration (the KV moves, adapters/emulator/migration.py) or, when the decode instance
dies mid-stream, a failover: prompt + the text already streamed are sent to another decode
instance, which recomputes them and continues (as Dynamo's request migration does).

The gateway handler parses the HTTP request, builds a LiveRequest and calls `run` with the console's
RequestServices (console/live/services.py) and a channel to its client. From then on this object asks
the dispatcher for every decision (at arrival, after a queue wait, at prefill end for policies that bind
late), drives the two P/D legs through adapters.vllm.forward, and hands its decode side to a DecodeRelay
(console/live/relay.py), which sends the decode legs, relays the stream, follows migrations and fails
over, and returns what happened. It is the only writer of its RequestRecord (console/live/record.py);
when it ends it tells the dispatcher, the outcomes, the held queue and its tenant, once each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from adapters.vllm.forward import (
    CONNECTION_ERRORS,
    StreamBroken,
    UpstreamFailure,
    decode_leg,
    prefill_leg,
)
from adapters.vllm.lora import AdapterCallError
from adapters.vllm.pd_protocol import SSETokenCounter, completion_tokens, decode_leg_body, prefill_leg_body
from console.live.channel import JSON_HEADERS, ClientChannel, Rejected
from console.live.record import Outcome, RequestRecord, Step
from console.live.relay import DecodeRelay, FailOver, Relayed
from console.live.tracing import NO_TRACE, SpanHooks
from core.errors import NoCapacityError
from core.types import Admission, Request, Role

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.services import RequestServices

log = logging.getLogger(__name__)
PREFILL_ATTEMPTS = 2
"""A prefill leg that fails (instance unreachable or 5xx) is sent once more, to another instance."""


def cached_tokens(reply: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a prefill leg's reply, when the engine reports it."""
    details = (reply.get("usage") or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int else None


class LiveRequest:
    """One request through the gateway; see the module docstring for its life."""

    __slots__ = ("id", "request", "path", "body", "stream", "forward_headers", "record", "trace", "relay", "s")
    s: RequestServices
    """The console's parts it uses (given to `run`)."""

    def __init__(
        self, request: Request, path: str, body: dict[str, Any], forward_headers: bytes, model: str = ""
    ) -> None:
        self.request = request
        self.id = str(request.id)
        self.path = path
        self.body = body
        self.stream = bool(body.get("stream"))
        self.forward_headers = forward_headers
        """Header lines both legs carry (X-Request-Id, the client's Authorization)."""
        self.record = RequestRecord(request, self.stream, model=model)
        """What happened to it, as it happens (written here only)."""
        self.trace: SpanHooks = NO_TRACE  # its spans when [tracing] is on (console/live/tracing.py, set by the gateway)
        self.relay: DecodeRelay | None = None
        """Its decode side, from the binding of its decode instance on."""

    # --- the life ---------------------------------------------------------------------------------
    async def run(self, services: RequestServices, client: ClientChannel) -> None:
        """Serve this request end to end; its end is told to each part exactly once."""
        self.s = services
        rec = self.record
        services.outcomes.started(rec)
        try:
            await self._admit(client)
            if self.request.lora is not None:
                await self._under_adapter()
            reply = await self._prefill()
            rec.cached_tokens = cached_tokens(reply)
            await self._decode(client, reply)
        except Rejected as e:
            rec.reason, rec.outcome = str(e), e.outcome
            if not client.gone.is_set():
                await client.error(e.status, str(e), e.retry_after_s)
        except UpstreamFailure as e:
            rec.reason, rec.outcome = str(e), Outcome.UPSTREAM
            if e.status < 500 and e.body:
                await client.respond(e.status, e.body)  # the instance's own 4xx, as vLLM's proxy does
            else:
                await client.error(502, str(e))
        except Exception as e:  # a bug of ours: recorded, logged, answered in the OpenAI shape
            rec.reason, rec.outcome = f"internal error: {type(e).__name__}: {e}", Outcome.INTERNAL
            log.exception("request %s failed inside the gateway", self.id)
            if not client.started and not client.gone.is_set():
                await client.error(
                    500, f"the gateway failed on this request ({type(e).__name__}); it is recorded as {self.id}"
                )
        finally:
            client.close()
            self._end()

    def _end(self) -> None:
        """Close the record, then tell the dispatcher, the outcomes, the held queue and the tenant."""
        s, rec, relay = self.s, self.record, self.relay
        if relay is not None:
            if relay.resume_leg is not None:
                relay.drop_resume()
            s.migrations.left(self.id)
            rec.tried_decode, rec.dp_rank, rec.first_token_at = relay.tried_decode, relay.dp_rank, relay.first_token_at
        if self.request.lora is not None and s.lora is not None:
            s.lora.release(self.id)
        if rec.outcome is None:  # its task was cancelled (the server stopping under it)
            rec.outcome = Outcome.ABANDONED if rec.step == Step.QUEUED else Outcome.CLIENT_GONE
        if rec.recovered is not None:
            rec.reason = rec.recovered if rec.reason is None else f"{rec.recovered}; then {rec.reason}"
        ok = rec.ok
        finish = rec.enter(Step.FINISHED if ok else Step.FAILED)
        self.trace.finish(rec)
        if ok:
            s.dispatcher.on_finish(self.request.id, finish, rec.output_tokens, rec.first_token_at)
        else:
            s.dispatcher.on_fail(self.request.id, finish)
        s.outcomes.left(rec)
        s.held.release()
        s.tenants.finished(rec, s.outcomes.record(rec))

    async def _admit(self, client: ClientChannel) -> None:
        """The tenant's limits, the queue policy's decision, then the routing policy's."""
        s, rec = self.s, self.record
        s.tenants.admit(rec)
        if s.arrivals is not None:
            s.arrivals.note(self.request, any(self.body.get(k) for k in ("max_tokens", "max_completion_tokens")))
        d = s.dispatcher
        decision = d.admit(self.request, self.request.arrival)
        if decision == Admission.SHED:
            raise Rejected(429, d.shed_reason, s.held.retry_after_s(), outcome=Outcome.SHED)
        if decision == Admission.QUEUED:
            rec.enter(Step.QUEUED)
            released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            s.held.hold(self.id, released)
            client.watch()
            gone: asyncio.Future[Any] = asyncio.ensure_future(client.gone.wait())
            waiting: set[asyncio.Future[Any]] = {released, gone}
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not released.done():
                d.cancel(self.request.id)
                s.held.unhold(self.id)
                raise Rejected(499, "client disconnected while queued", outcome=Outcome.ABANDONED)
            released.result()  # raises Rejected when the request expired in the queue
        now = time.monotonic()
        try:
            t = time.perf_counter()
            assignment = d.route(self.request, now)
            s.metrics.decision_time.observe(time.perf_counter() - t)
        except NoCapacityError as e:
            raise Rejected(
                503,
                f"no capacity: {e}; try again when instances recover",
                s.held.retry_after_s(),
                outcome=Outcome.NO_CAPACITY,
            ) from None
        rec.prefill_instance = assignment.prefill
        rec.decode_instance = assignment.decode
        rec.arm = d.arm_of(self.request.id)  # routed under a canary's candidate, or the active policy
        self.trace.routed(rec, d, now)
        if s.engine_priorities:
            prio = d.queue.engine_priority(self.request)
            if prio is not None:
                self.body = {**self.body, "priority": prio}

    async def _under_adapter(self) -> None:
        """Both legs run under the request's LoRA adapter: it is loaded on its prefill and decode instances
        (concurrently, before the first leg; the wait is part of its TTFT and recorded). An instance that
        cannot load it is replaced by another of its role, one holding the adapter when one is routable;
        with none left the request fails with the instance's and vLLM's reason."""
        rec = self.record
        t = time.monotonic()
        legs = [self._adapter_leg(Role.PREFILL)]
        if rec.decode_instance is not None:
            legs.append(self._adapter_leg(Role.DECODE))
        await asyncio.gather(*legs)
        rec.lora_wait_s += time.monotonic() - t

    async def _adapter_leg(self, role: Role) -> None:
        """Load the adapter on this request's instance of `role` (moving the leg when it cannot be)."""
        s, rec, adapter = self.s, self.record, self.request.lora
        assert adapter is not None
        if s.lora is None:
            raise Rejected(404, f"The model `{adapter}` does not exist.", outcome=Outcome.UPSTREAM)
        tried: list[str] = []
        while True:
            iid = rec.prefill_instance if role == Role.PREFILL else rec.decode_instance
            if iid is None:
                return
            try:
                await s.lora.place(self.id, s.instances[iid], adapter)
                return
            except AdapterCallError as e:
                tried.append(iid)
                holders = s.lora.holders(adapter) - set(tried)
                index = s.dispatcher.view.index
                members = [i for i, inst in s.instances.items() if inst.role in (role, Role.BOTH) and i in index]
                avoid = tried + [i for i in members if i not in holders] if holders else tried
                retry = s.dispatcher.retry_prefill if role == Role.PREFILL else s.dispatcher.retry_decode
                moved = retry(self.request.id, avoid, time.monotonic())
                if moved is None and holders:  # no holder is routable: any instance not tried
                    moved = retry(self.request.id, tried, time.monotonic())
                if moved is None:
                    raise Rejected(502, str(e), outcome=Outcome.UPSTREAM) from None
                if role == Role.PREFILL:
                    rec.prefill_instance = moved
                else:
                    rec.decode_instance = moved
                self._saved(f"{e}; its {role.value} leg moved to {moved}")

    async def _prefill(self) -> dict[str, Any]:
        """Leg 1, sent once more to another prefill instance if the first one is at fault.

        A decode-only assignment (no prefill instance: the decode instance already holds most of the
        prompt, llm-d's prefix-based P/D decider) has no leg 1: the decode leg goes without
        `kv_transfer_params` and the decode instance computes the uncached rest itself."""
        s, rec = self.s, self.record
        if rec.prefill_instance is None:
            return {}
        d = s.dispatcher
        payload = orjson.dumps(prefill_leg_body(self.body))
        rid = self.request.id
        while True:
            inst = s.instances[rec.prefill_instance or ""]
            now = rec.enter(Step.PREFILL)
            d.on_prefill_start(rid, now)
            headers = self.trace.prefill_leg(inst.id, self.forward_headers, now)
            try:
                reply = await prefill_leg(inst, self.path, payload, headers)
            except UpstreamFailure as e:
                self.trace.prefill_done(e)
                if not e.instance_fault:
                    raise
                s.health.upstream_failed(inst.id)
                rec.tried_prefill.append(inst.id)
                retry = (
                    d.retry_prefill(rid, rec.tried_prefill, time.monotonic())
                    if len(rec.tried_prefill) < PREFILL_ATTEMPTS
                    else None
                )
                if retry is None:
                    raise
                rec.prefill_instance = retry
                continue
            end = time.monotonic()
            self.trace.prefill_done()
            d.on_prefill_end(rid, end, end - now)
            inst.routed += 1
            s.health.upstream_ok(inst.id)
            s.held.release()  # a queue policy may hold arrivals while prefill is backlogged
            return reply

    async def _decode(self, client: ClientChannel, reply: dict[str, Any]) -> None:
        """Bind the decode instance if the policy binds late, then leg 2, relayed to the client.

        The decode instance pulls the prompt's KV from the prefill instance. If that instance is
        marked down before the first token arrived, the pull may never finish (vLLM keeps a NIXL
        read to a dead peer open): the leg is dropped and sent again without `kv_transfer_params`,
        so the decode instance computes the prompt itself."""
        s, rec = self.s, self.record
        d = s.dispatcher
        rid = self.request.id
        if rec.decode_instance is None:
            bind_at = time.monotonic()
            try:
                rec.decode_instance = d.bind_late(rid, bind_at)
            except NoCapacityError as e:
                raise Rejected(
                    503,
                    f"no capacity at prefill end: {e}; try again when instances recover",
                    s.held.retry_after_s(),
                    outcome=Outcome.NO_CAPACITY,
                ) from None
            self.trace.bound_late(rec.decode_instance, bind_at)
            if self.request.lora is not None:
                t = time.monotonic()
                await self._adapter_leg(Role.DECODE)
                rec.lora_wait_s += time.monotonic() - t
        rec.enter(Step.DECODE_BOUND)
        dec = s.instances[rec.decode_instance]
        kv = reply.get("kv_transfer_params")
        relay = DecodeRelay(s, self.request, self.path, self.body, self.forward_headers, self.trace, dec.id)
        self.relay = relay
        s.migrations.decoding(self.id, relay)
        d.on_decode_start(rid, rec.enter(Step.DECODING))
        try:
            await self._decode_with_kv(client, dec, kv)
        except UpstreamFailure as e:
            if e.status != 502 or client.started or rec.output_tokens:
                raise
            if e.delivered:
                # the leg reached the instance before it died: it may have pulled the KV (which
                # frees it on the prefill instance), so the next one computes the prompt itself
                moved = relay.fail_over(
                    e.instance_id, 0, f"decode {e.instance_id} failed before anything reached the client: {e}"
                )
                if moved.target is None:
                    raise UpstreamFailure(e.instance_id, 503, moved.note) from None
                self._moved(moved)
                await self._decode_leg(client, moved.target, orjson.dumps(decode_leg_body(self.body, None)))
                return
            # refused before it was sent: the KV still waits on the prefill instance, so another
            # decode instance can pull it
            retry = d.retry_decode(rid, [dec.id], time.monotonic())
            if retry is None:
                raise
            self._saved(f"{e} before its first token: sent to {retry} with the prompt's KV")
            rec.decode_instance = retry
            if self.request.lora is not None:
                await self._adapter_leg(Role.DECODE)
            await self._decode_with_kv(client, s.instances[rec.decode_instance], kv)

    async def _decode_with_kv(self, client: ClientChannel, dec: Instance, kv: dict[str, Any] | None) -> None:
        """Leg 2 on `dec`, recomputing the prompt there if its prefill instance is lost first."""
        if kv is None:
            await self._decode_leg(client, dec, orjson.dumps(decode_leg_body(self.body, None)))
            return
        rec, relay = self.record, self.relay
        assert relay is not None
        lost = self.s.health.lost_signal(rec.prefill_instance or "")
        cut = False
        note = ""
        if not lost.done():
            # No task per request: if the prefill instance is lost before the first token, this
            # request's own task is cancelled out of the leg (and uncancelled below).
            me = asyncio.current_task()
            assert me is not None

            def on_lost(_: asyncio.Future[None]) -> None:
                nonlocal cut
                if relay.first_token_at is None:
                    cut = True
                    me.cancel()

            lost.add_done_callback(on_lost)
            try:
                await self._decode_leg(client, dec, orjson.dumps(decode_leg_body(self.body, kv)))
                return
            except asyncio.CancelledError:
                if not cut or me.uncancel() > 0:
                    raise
            except UpstreamFailure as e:
                # vLLM's kv_load_failure_policy "fail" (its default) answers 500 when the pull from
                # the prefill instance fails (it died, or the KV expired): the prompt is computed
                # on the same decode instance instead, once
                if e.status < 500 or e.delivered or client.started or rec.output_tokens or e.instance_id != dec.id:
                    raise
                cut = False
                note = (
                    f"decode {dec.id} answered {e.status} before its first token, as when the prompt's KV cannot be "
                    f"pulled from prefill {rec.prefill_instance}: the prompt was recomputed on {dec.id}"
                )
            finally:
                lost.remove_done_callback(on_lost)
        if cut or lost.done():
            note = (
                f"prefill {rec.prefill_instance} was lost before decode {dec.id} received the prompt's KV: "
                f"the prompt was recomputed on {dec.id}"
            )
        self._saved(note)
        await self._decode_leg(client, dec, orjson.dumps(decode_leg_body(self.body, None)))

    async def _decode_leg(self, client: ClientChannel, dec: Instance, payload: bytes) -> None:
        """One decode leg to `dec`, its answer relayed to the client."""
        s, rec, relay = self.s, self.record, self.relay
        assert relay is not None
        try:
            async with decode_leg(dec, self.path, payload, relay.leg_headers(dec)) as r:
                dec.routed += 1
                if not self.stream:
                    try:
                        raw = await r.read()
                    except CONNECTION_ERRORS as e:
                        raise StreamBroken(SSETokenCounter(), f"{type(e).__name__}: {e}") from None
                    # a whole reply: no token is seen before the last, so first_token_at stays None
                    # (TPOT unknown; console/live/outcomes.py takes TTFT from the prefill leg's end)
                    rec.output_tokens = completion_tokens(orjson.loads(raw))
                    rec.outcome = Outcome.OK
                    s.health.upstream_ok(dec.id)
                    await client.respond(200, raw, [*JSON_HEADERS, (b"x-request-id", self.id.encode())])
                    return
                if not client.started:
                    await client.start_stream(self.id)
                    client.watch()
                relayed = await relay.relay(client, r)
                while self._relayed(relayed):
                    relayed = await relay.resume(client)
        except UpstreamFailure as e:
            if e.instance_fault:
                s.health.upstream_failed(dec.id)
            self.trace.decode_failed(dec.id, e)
            raise
        except StreamBroken as e:  # a whole (non-streamed) reply broke off: nothing reached the client
            s.health.upstream_failed(dec.id)
            moved = relay.fail_over(dec.id, 0, f"decode {dec.id} failed before its reply was complete: {e}")
            if moved.target is None:
                raise UpstreamFailure(dec.id, 503, moved.note) from None  # not 502: the KV is gone, no plain retry
            self._moved(moved)
            await self._decode_leg(client, moved.target, orjson.dumps(decode_leg_body(self.body, None)))

    # --- what the relay returned, written down ----------------------------------------------------
    def _relayed(self, relayed: Relayed) -> bool:
        """Record a stretch of the relayed stream; whether it moved (and goes on)."""
        rec = self.record
        rec.decode_instance = relayed.decode_id
        for note in relayed.notes:
            self._saved(note)
        if relayed.moved:
            return True
        rec.outcome, rec.output_tokens = relayed.outcome, relayed.output_tokens
        if relayed.reason is not None:
            rec.reason = relayed.reason
        return False

    def _moved(self, moved: FailOver) -> None:
        """A failover before anything reached the client: the request continues on `moved.target`."""
        assert moved.target is not None
        self._saved(moved.note)
        self.record.decode_instance = moved.target.id

    def _saved(self, note: str) -> None:
        self.record.saved(note)
        log.warning("request %s: %s", self.id, note)
