"""LiveRequest: the one object that owns a live request from admission to its outcome.

Its life, each step stamped with the time it was entered:

    admitted → [queued] → prefill (retried once elsewhere) → decode bound → decoding → finished
                                                                             (→ moved) ↘ failed

"Moved" is a migration (the KV moves, adapters/emulator/migration.py) or, when the decode instance
dies mid-stream, a failover: prompt + the text already streamed are sent to another decode
instance, which recomputes them and continues (as Dynamo's request migration does).

The gateway handler parses the HTTP request, builds a LiveRequest and calls `run` with a channel
to its client; from then on this object asks its host's dispatcher for every decision (at
arrival, after a queue wait, at prefill end for policies that bind late), drives the two P/D legs
through adapters.vllm.forward, relays the decode stream to the client (console/live/relay.py, which
also follows migrations and fails over), and hands its outcome to its host once. Nothing else
builds or mutates the outcome. The host is anything with the members of `RequestHost` (the running
console's controller, or a fake in a test).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from adapters.http.upstream import Response
from adapters.vllm.forward import (
    CONNECTION_ERRORS,
    StreamBroken,
    UpstreamFailure,
    decode_leg,
    open_decode,
    prefill_leg,
)
from adapters.vllm.pd_protocol import (
    SSETokenCounter,
    completion_tokens,
    decode_leg_body,
    prefill_leg_body,
    resume_leg_body,
)
from console.live.channel import JSON_HEADERS, ClientChannel, Rejected
from console.live.relay import relay
from console.live.request_host import RequestHost, Step, cached_tokens
from console.live.tracing import NO_TRACE, Trace
from core.errors import NoCapacityError
from core.types import Admission, Request

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance

log = logging.getLogger(__name__)
PREFILL_ATTEMPTS = 2
"""A prefill leg that fails (instance unreachable or 5xx) is sent once more, to another instance."""


class LiveRequest:
    """One request through the gateway; see the module docstring for its life."""

    __slots__ = (
        "id",
        "request",
        "path",
        "body",
        "stream",
        "forward_headers",
        "step",
        "times",
        "prefill_instance",
        "decode_instance",
        "tried_prefill",
        "output_tokens",
        "reason",
        "ok",
        "released",
        "first_token_at",
        "recovered",
        "migrating_to",
        "handed_over",
        "last_token_at",
        "resume_leg",
        "tried_decode",
        "dp_rank",
        "cached_tokens",
        "trace",
    )

    def __init__(self, request: Request, path: str, body: dict[str, Any], forward_headers: bytes) -> None:
        self.request = request
        self.id = str(request.id)
        self.path = path
        self.body = body
        self.stream = bool(body.get("stream"))
        self.forward_headers = forward_headers
        """Header lines both legs carry (X-Request-Id, the client's Authorization)."""
        self.step = Step.ADMITTED
        self.times: dict[Step, float] = {Step.ADMITTED: request.arrival}
        """When each step was entered (monotonic seconds)."""
        self.prefill_instance: str | None = None
        self.decode_instance: str | None = None
        self.tried_prefill: list[str] = []
        self.tried_decode: list[str] = []
        """Decode instances that failed this request (refused it, or died mid-stream)."""
        self.output_tokens = 0
        self.reason: str | None = None
        self.ok = False
        self.released: asyncio.Future[None] | None = None
        """Resolved by the host when a queued request may be routed."""
        self.first_token_at: float | None = None
        self.migrating_to: str | None = None
        """The decode instance this request is being migrated to (set by the console's operations)."""
        self.handed_over: tuple[str, str, float, int] | None = None
        """(source, target, last token time, tokens) before a migration whose first token after it
        has not come yet."""
        self.last_token_at: float | None = None
        self.resume_leg: asyncio.Future[Response] | None = None
        """The continuation stream on the migration target, opened ahead of the hand-off."""
        self.recovered: str | None = None
        """What the gateway did to save this request after a failure (it is recorded as the reason)."""
        self.cached_tokens: int | None = None
        """Prompt tokens its prefill instance found in its prefix cache (reported by an engine started with
        --enable-prompt-tokens-details; None: not reported, or no prefill leg)."""
        self.dp_rank: int | None = None
        """The data-parallel rank its decode leg asked for (a decode instance that is a DP group)."""
        self.trace: Trace = NO_TRACE  # its spans when [tracing] is on (console/live/tracing.py, set by the gateway)

    def enter(self, step: Step, now: float | None = None) -> float:
        """Move to `step` and stamp it."""
        t = time.monotonic() if now is None else now
        self.step = step
        self.times[step] = t
        return t

    def at(self, step: Step) -> float | None:
        return self.times.get(step)

    # --- the life ---------------------------------------------------------------------------------
    async def run(self, c: RequestHost, client: ClientChannel) -> None:
        """Serve this request end to end; the outcome reaches the host exactly once."""
        c.request_started(self)
        try:
            await self._admit(c, client)
            reply = await self._prefill(c)
            self.cached_tokens = cached_tokens(reply)
            await self._decode(c, client, reply)
        except Rejected as e:
            self.reason = str(e)
            if not client.gone.is_set():
                await client.error(e.status, str(e), e.retry_after_s)
        except UpstreamFailure as e:
            self.reason = str(e)
            if e.status < 500 and e.body:
                await client.respond(e.status, e.body)  # the instance's own 4xx, as vLLM's proxy does
            else:
                await client.error(502, str(e))
        except Exception as e:  # a bug of ours: recorded, logged, answered in the OpenAI shape
            self.reason = f"internal error: {type(e).__name__}: {e}"
            log.exception("request %s failed inside the gateway", self.id)
            if not client.started and not client.gone.is_set():
                await client.error(
                    500, f"the gateway failed on this request ({type(e).__name__}); it is recorded as {self.id}"
                )
        finally:
            client.close()
            self.drop_resume()
            if self.recovered is not None:
                self.reason = self.recovered if self.reason is None else f"{self.recovered}; then {self.reason}"
            self.enter(Step.FINISHED if self.ok else Step.FAILED)
            self.trace.finish(self)
            c.request_done(self)

    async def _admit(self, c: RequestHost, client: ClientChannel) -> None:
        """The tenant's limits, the queue policy's decision, then the routing policy's."""
        c.admit_tenant(self)
        d = c.dispatcher
        decision = d.admit(self.request, self.request.arrival)
        if decision == Admission.SHED:
            raise Rejected(429, d.shed_reason, c.retry_after_s())
        if decision == Admission.QUEUED:
            self.enter(Step.QUEUED)
            self.released = asyncio.get_running_loop().create_future()
            c.hold(self)
            client.watch()
            gone: asyncio.Future[Any] = asyncio.ensure_future(client.gone.wait())
            waiting: set[asyncio.Future[Any]] = {self.released, gone}
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not self.released.done():
                d.cancel(self.request.id)
                c.unhold(self)
                raise Rejected(499, "client disconnected while queued")
            self.released.result()  # raises Rejected when the request expired in the queue
        now = time.monotonic()
        try:
            t = time.perf_counter()
            assignment = d.route(self.request, now)
            c.metrics.decision_time.observe(time.perf_counter() - t)
        except NoCapacityError as e:
            raise Rejected(503, f"no capacity: {e}; try again when instances recover", c.retry_after_s()) from None
        self.prefill_instance = assignment.prefill
        self.decode_instance = assignment.decode
        self.trace.routed(self, d, now)
        if c.engine_priorities:
            prio = d.queue.engine_priority(self.request)
            if prio is not None:
                self.body = {**self.body, "priority": prio}

    async def _prefill(self, c: RequestHost) -> dict[str, Any]:
        """Leg 1, sent once more to another prefill instance if the first one is at fault.

        A decode-only assignment (no prefill instance: the decode instance already holds most of the
        prompt, llm-d's prefix-based P/D decider) has no leg 1: the decode leg goes without
        `kv_transfer_params` and the decode instance computes the uncached rest itself."""
        if self.prefill_instance is None:
            return {}
        d = c.dispatcher
        payload = orjson.dumps(prefill_leg_body(self.body))
        rid = self.request.id
        while True:
            inst = c.instances[self.prefill_instance or ""]
            now = self.enter(Step.PREFILL)
            d.on_prefill_start(rid, now)
            headers = self.trace.prefill_leg(inst.id, self.forward_headers, now)
            try:
                reply = await prefill_leg(inst, self.path, payload, headers)
            except UpstreamFailure as e:
                self.trace.prefill_done(e)
                if not e.instance_fault:
                    raise
                c.upstream_failed(inst.id)
                self.tried_prefill.append(inst.id)
                retry = (
                    d.retry_prefill(rid, self.tried_prefill, time.monotonic())
                    if len(self.tried_prefill) < PREFILL_ATTEMPTS
                    else None
                )
                if retry is None:
                    raise
                self.prefill_instance = retry
                continue
            end = time.monotonic()
            self.trace.prefill_done()
            d.on_prefill_end(rid, end, end - now)
            inst.routed += 1
            c.upstream_ok(inst.id)
            c.release_queued()  # a queue policy may hold arrivals while prefill is backlogged
            return reply

    async def _decode(self, c: RequestHost, client: ClientChannel, reply: dict[str, Any]) -> None:
        """Bind the decode instance if the policy binds late, then leg 2, relayed to the client.

        The decode instance pulls the prompt's KV from the prefill instance. If that instance is
        marked down before the first token arrived, the pull may never finish (vLLM keeps a NIXL
        read to a dead peer open): the leg is dropped and sent again without `kv_transfer_params`,
        so the decode instance computes the prompt itself."""
        d = c.dispatcher
        rid = self.request.id
        if self.decode_instance is None:
            bind_at = time.monotonic()
            try:
                self.decode_instance = d.bind_late(rid, bind_at)
            except NoCapacityError as e:
                raise Rejected(
                    503, f"no capacity at prefill end: {e}; try again when instances recover", c.retry_after_s()
                ) from None
            self.trace.bound_late(self.decode_instance, bind_at)
        self.enter(Step.DECODE_BOUND)
        dec = c.instances[self.decode_instance]
        kv = reply.get("kv_transfer_params")
        d.on_decode_start(rid, self.enter(Step.DECODING))
        try:
            await self._decode_with_kv(c, client, dec, kv)
        except UpstreamFailure as e:
            if e.status != 502 or client.started or self.output_tokens:
                raise
            if e.delivered:
                # the leg reached the instance before it died: it may have pulled the KV (which
                # frees it on the prefill instance), so the next one computes the prompt itself
                target = self.fail_over(
                    c, e.instance_id, 0, f"decode {e.instance_id} failed before anything reached the client: {e}"
                )
                if target is None:
                    raise UpstreamFailure(e.instance_id, 503, self.reason or str(e)) from None
                await self._decode_leg(c, client, target, orjson.dumps(decode_leg_body(self.body, None)))
                return
            # refused before it was sent: the KV still waits on the prefill instance, so another
            # decode instance can pull it
            retry = d.retry_decode(rid, [dec.id], time.monotonic())
            if retry is None:
                raise
            note = f"{e} before its first token: sent to {retry} with the prompt's KV"
            self.recovered = note if self.recovered is None else f"{self.recovered}; {note}"
            log.warning("request %s: %s", self.id, note)
            self.decode_instance = retry
            await self._decode_with_kv(c, client, c.instances[retry], kv)

    async def _decode_with_kv(
        self, c: RequestHost, client: ClientChannel, dec: Instance, kv: dict[str, Any] | None
    ) -> None:
        """Leg 2 on `dec`, recomputing the prompt there if its prefill instance is lost first."""
        if kv is None:
            await self._decode_leg(c, client, dec, orjson.dumps(decode_leg_body(self.body, None)))
            return
        lost = c.lost_signal(self.prefill_instance or "")
        cut = False
        note = ""
        if not lost.done():
            # No task per request: if the prefill instance is lost before the first token, this
            # request's own task is cancelled out of the leg (and uncancelled below).
            me = asyncio.current_task()
            assert me is not None

            def on_lost(_: asyncio.Future[None]) -> None:
                nonlocal cut
                if self.first_token_at is None:
                    cut = True
                    me.cancel()

            lost.add_done_callback(on_lost)
            try:
                await self._decode_leg(c, client, dec, orjson.dumps(decode_leg_body(self.body, kv)))
                return
            except asyncio.CancelledError:
                if not cut or me.uncancel() > 0:
                    raise
            except UpstreamFailure as e:
                # vLLM's kv_load_failure_policy "fail" (its default) answers 500 when the pull from
                # the prefill instance fails (it died, or the KV expired): the prompt is computed
                # on the same decode instance instead, once
                if e.status < 500 or e.delivered or client.started or self.output_tokens or e.instance_id != dec.id:
                    raise
                cut = False
                note = (
                    f"decode {dec.id} answered {e.status} before its first token, as when the prompt's KV cannot be "
                    f"pulled from prefill {self.prefill_instance}: the prompt was recomputed on {dec.id}"
                )
            finally:
                lost.remove_done_callback(on_lost)
        if cut or lost.done():
            note = (
                f"prefill {self.prefill_instance} was lost before decode {dec.id} received the prompt's KV: "
                f"the prompt was recomputed on {dec.id}"
            )
        self.recovered = note if self.recovered is None else f"{self.recovered}; {note}"
        log.warning("request %s: %s", self.id, note)
        await self._decode_leg(c, client, dec, orjson.dumps(decode_leg_body(self.body, None)))

    async def _decode_leg(self, c: RequestHost, client: ClientChannel, dec: Instance, payload: bytes) -> None:
        """One decode leg to `dec`, its answer relayed to the client."""
        try:
            async with decode_leg(dec, self.path, payload, self.leg_headers(c, dec)) as r:
                dec.routed += 1
                if not self.stream:
                    try:
                        raw = await r.read()
                    except CONNECTION_ERRORS as e:
                        raise StreamBroken(SSETokenCounter(), f"{type(e).__name__}: {e}") from None
                    # a whole reply: no token is seen before the last, so first_token_at stays None
                    # (TPOT unknown; console/live/outcomes.py takes TTFT from the prefill leg's end)
                    self.output_tokens = completion_tokens(orjson.loads(raw))
                    self.ok = True
                    c.upstream_ok(dec.id)
                    await client.respond(200, raw, [*JSON_HEADERS, (b"x-request-id", self.id.encode())])
                    return
                if not client.started:
                    await client.start_stream(self.id)
                    client.watch()
                await relay(self, c, client, r, dec.id)
        except UpstreamFailure as e:
            if e.instance_fault:
                c.upstream_failed(dec.id)
            self.trace.decode_failed(dec.id, e)
            raise
        except StreamBroken as e:  # a whole (non-streamed) reply broke off: nothing reached the client
            c.upstream_failed(dec.id)
            target = self.fail_over(c, dec.id, 0, f"decode {dec.id} failed before its reply was complete: {e}")
            if target is None:
                raise UpstreamFailure(
                    dec.id, 503, self.reason or str(e)
                ) from None  # not 502: the KV is gone, no plain retry
            await self._decode_leg(c, client, target, orjson.dumps(decode_leg_body(self.body, None)))

    def fail_over(self, c: RequestHost, failed: str, streamed: int, why: str) -> Instance | None:
        """Rebind this request to another decode instance after `failed` died under it; None (and
        the reason set) when the attempts are used up or no decode instance is left."""
        self.tried_decode.append(failed)
        limit = c.config.failure_migration_attempts
        if len(self.tried_decode) > limit:
            self.reason = f"{why} (failure migration: {limit} attempt{'s' if limit != 1 else ''} allowed, used)"
            return None
        target = c.dispatcher.retry_decode(self.request.id, self.tried_decode, time.monotonic())
        if target is None:
            self.reason = f"{why}; no other decode instance to continue it"
            return None
        self.trace.failed_over(failed, target, streamed, why)
        note = f"{why}: resumed on {target} after {streamed} tokens by recomputing prompt + streamed tokens"
        self.recovered = note if self.recovered is None else f"{self.recovered}; {note}"
        log.warning("request %s: %s", self.id, note)
        self.decode_instance = target
        return c.instances[target]

    def leg_headers(self, c: RequestHost, dec: Instance) -> bytes:
        """The decode leg's extra headers: the client's, plus the rank the rank policy chose when
        `dec` is a data-parallel group (vLLM's X-data-parallel-rank), plus the leg's traceparent when tracing."""
        headers = self.forward_headers
        if dec.dp_size > 1:
            self.dp_rank = c.dispatcher.choose_rank(self.request.id, time.monotonic())
            if self.dp_rank is not None:
                headers += b"X-data-parallel-rank: %d\r\n" % self.dp_rank
        return self.trace.decode_leg(dec.id, headers)

    def open_resume(self, target: Instance) -> None:
        """Open the stream that continues this request on `target` before its migration's last stage,
        so the target decodes the moment the KV lands (the console's operations call this, then migrate)."""
        self.resume_leg = asyncio.ensure_future(self.resume_stream(target))

    def drop_resume(self) -> None:
        """The migration was given up: close the stream opened on the target."""
        leg, self.resume_leg = self.resume_leg, None
        if leg is not None:
            leg.cancel()
            leg.add_done_callback(
                lambda f: f.result().release() if not f.cancelled() and f.exception() is None else None
            )

    async def resume_stream(self, target: Instance) -> Response:
        """Open the stream that continues this request on `target`, where its migration lands it."""
        headers = self.trace.decode_leg(target.id, self.forward_headers, "migration")
        return await open_decode(target, self.path, orjson.dumps(resume_leg_body(self.body, self.id)), headers)
