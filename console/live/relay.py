"""A live request's decode side (`DecodeRelay`): decode leg headers, failover, migration hand-offs, the relayed stream.

It owns what it tracks and returns what happened; it never writes the request's record nor calls the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from adapters.http.upstream import Response
from adapters.vllm.forward import StreamBroken, UpstreamFailure, open_decode, relay_stream, tokenize
from adapters.vllm.lora import AdapterCallError
from adapters.vllm.pd_protocol import (
    SSETokenCounter,
    StreamTranscript,
    add_streamed_usage,
    continuation_body,
    prompt_is_token_ids,
    resume_leg_body,
)
from console.error_bodies import sse_error
from console.live.channel import ClientChannel, recording, usage_fixer
from console.live.record import Outcome

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.services import RequestServices
    from console.live.tracing import SpanHooks
    from core.types import Request

PROGRESS_EVERY_S = 0.05
"""How often a streaming request's token count is passed to the dispatcher (at most)."""


@dataclass(frozen=True, slots=True)
class Handover:
    """A migration handed over, waiting for its first token from the target."""

    source: str
    target: str
    last_token_at: float
    """When the last token from the source arrived."""
    tokens: int
    """Tokens streamed before the hand-over."""


@dataclass(frozen=True, slots=True)
class FailOver:
    """Where a request continues after its decode instance failed under it."""

    target: Instance | None
    """The decode instance it continues on (None: none, the attempts are used up or none is left)."""
    note: str
    """With a target: what was done to save it (recorded with its outcome); without one: why it failed."""


class Relayed(NamedTuple):
    """What a stretch of the relayed stream ended with: the stream ended, or it moved to `decode_id` (a
    migration's target, or a failure migration's continuation) and `resume` relays the rest (a named tuple:
    immutable, and one is made per request without a Python call per field)."""

    decode_id: str
    """The decode instance the stream came from last (or the last one tried)."""
    moved: bool
    notes: tuple[str, ...] = ()
    """What was done to save the request on the way (failure migrations), in order."""
    outcome: Outcome | None = None
    """How the request ended (None while it moved)."""
    reason: str | None = None
    """Why it failed (None when it did not)."""
    output_tokens: int = 0
    """Tokens generated when it ended."""


class DecodeRelay:
    """One request's decode side, from the binding of its decode instance to its end (one per request)."""

    def __init__(
        self,
        services: RequestServices,
        request: Request,
        path: str,
        body: dict[str, Any],
        forward_headers: bytes,
        trace: SpanHooks,
        decode_id: str,
    ) -> None:
        self.s = services
        self.request = request
        self.request_id = str(request.id)
        self.path = path
        self.body = body
        self.stream = bool(body.get("stream"))
        self.forward_headers = forward_headers
        self.trace = trace
        self.decode_id = decode_id
        """The decode instance the request decodes on now."""
        self.tried_decode: list[str] = []
        """Decode instances that failed this request (refused it, or died mid-stream)."""
        self.dp_rank: int | None = None
        """The data-parallel rank its last decode leg asked for (a decode instance that is a DP group)."""
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.migrating_to: str | None = None
        """The decode instance this request is being migrated to (set by console.live.migrations)."""
        self.handed_over: Handover | None = None
        self.resume_leg: asyncio.Future[Response] | None = None
        """The continuation stream on the migration target, opened ahead of the hand-off."""
        # the stream being relayed (see `relay` and `resume`)
        self._r: Any = None
        self._counter: SSETokenCounter | None = None
        self._last = b""
        self._relayed: Callable[[bytes], Awaitable[None]] | None = None
        self._write: Callable[[bytes], Awaitable[None]] | None = None
        self._transcript: StreamTranscript | None = None
        self._legs: list[Response] = []
        self._next_report = 0.0

    # --- migrations (console.live.migrations.Migratable) ------------------------------------------
    @property
    def migrating(self) -> bool:
        return self.migrating_to is not None or self.handed_over is not None

    def expect_migration(self, target: Instance) -> None:
        """Open the stream that continues this request on `target` before its migration's last stage,
        so the target decodes the moment the KV lands."""
        self.migrating_to = target.id
        self.resume_leg = asyncio.ensure_future(self._resume_stream(target))

    def give_up_migration(self) -> None:
        self.migrating_to = None
        self.drop_resume()

    def drop_resume(self) -> None:
        """Close the continuation opened on a migration's target (the migration was given up, or the request ended)."""
        leg, self.resume_leg = self.resume_leg, None
        if leg is not None:
            leg.cancel()
            leg.add_done_callback(
                lambda f: f.result().release() if not f.cancelled() and f.exception() is None else None
            )

    async def _resume_stream(self, target: Instance) -> Response:
        await self._under_adapter(target)
        headers = self.trace.decode_leg(target.id, self.forward_headers, "migration")
        return await open_decode(target, self.path, orjson.dumps(resume_leg_body(self.body, self.request_id)), headers)

    async def _under_adapter(self, target: Instance) -> None:
        """The request's LoRA adapter is loaded on `target` before a leg goes there (both legs run under it);
        an UpstreamFailure of the target's when it cannot be."""
        adapter, lora = self.request.lora, self.s.lora
        if adapter is None or lora is None:
            return
        try:
            await lora.place(self.request_id, target, adapter)
        except AdapterCallError as e:
            raise UpstreamFailure(target.id, 502, str(e)) from None

    # --- legs --------------------------------------------------------------------------------------
    def leg_headers(self, dec: Instance) -> bytes:
        """A decode leg to `dec` is sent (the request decodes there now); its extra headers: the client's, plus
        the rank the rank policy chose when `dec` is a data-parallel group (vLLM's X-data-parallel-rank), plus
        the leg's traceparent when tracing."""
        self.decode_id = dec.id
        headers = self.forward_headers
        if dec.dp_size > 1:
            self.dp_rank = self.s.dispatcher.choose_rank(self.request.id, time.monotonic())
            if self.dp_rank is not None:
                headers += b"X-data-parallel-rank: %d\r\n" % self.dp_rank
        return self.trace.decode_leg(dec.id, headers)

    def fail_over(self, failed: str, streamed: int, why: str) -> FailOver:
        """Rebind the request to another decode instance after `failed` died under it."""
        self.tried_decode.append(failed)
        limit = self.s.failure_migration_attempts
        if len(self.tried_decode) > limit:
            attempts = f"{limit} attempt{'s' if limit != 1 else ''}"
            return FailOver(None, f"{why} (failure migration: {attempts} allowed, used)")
        target = self.s.dispatcher.retry_decode(self.request.id, self.tried_decode, time.monotonic())
        if target is None:
            return FailOver(None, f"{why}; no other decode instance to continue it")
        self.trace.failed_over(failed, target, streamed, why)
        self.decode_id = target
        return FailOver(
            self.s.instances[target],
            f"{why}: resumed on {target} after {streamed} tokens by recomputing prompt + streamed tokens",
        )

    # --- the stream --------------------------------------------------------------------------------
    def _on_tokens(self, n: int) -> None:
        # The dispatcher learns this request's progress at most every PROGRESS_EVERY_S: its
        # decode-rate estimate needs no more, and a busy stream sends tens of tokens a second.
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        if self.handed_over is not None:
            h, self.handed_over = self.handed_over, None
            self.s.migrations.landed(
                self.request_id, h.source, h.target, h.last_token_at, h.tokens, now, self.first_token_at
            )
            self.trace.migrated(now)
        self.last_token_at = now
        if now >= self._next_report:
            self._next_report = now + PROGRESS_EVERY_S
            self.s.dispatcher.on_progress(self.request.id, n, now)

    def relay(self, client: ClientChannel, r: Any) -> Coroutine[Any, Any, Relayed]:
        """Relay the decode stream `r` (from `decode_id`) to the client until it ends or moves (then `resume`).
        Await it: it sets the stream up and returns `resume`'s coroutine (one coroutine less per request)."""
        self._r, self._counter, self._last, self._next_report = r, None, b"", 0.0
        relayed: Callable[[bytes], Awaitable[None]] = client.write
        self._transcript = None
        if self.s.failure_migration_attempts:
            self._transcript = StreamTranscript(self.path.endswith("chat/completions"))
            relayed = recording(relayed, self._transcript.add)
        self._relayed = self._write = relayed
        return self.resume(client)

    async def resume(self, client: ClientChannel) -> Relayed:
        """Go on relaying after a move."""
        try:
            result = await self._relay(client)
        except BaseException:
            self._release_legs()
            raise
        if not result.moved:
            self._release_legs()
        return result

    def _release_legs(self) -> None:
        """The continuation legs this relay opened (the first leg is its caller's)."""
        legs = self._legs
        if legs:
            self._legs = []
            for leg in legs:
                leg.release()

    async def _relay(self, client: ClientChannel) -> Relayed:
        assert self._write is not None and self._relayed is not None
        decode_id = self.decode_id
        try:
            self._counter, handoff, self._last = await relay_stream(
                self._r, self._write, self._on_tokens, client.gone, self._counter
            )
        except StreamBroken as e:
            self.s.health.upstream_failed(decode_id)
            notes, refusal, resumed = await self._resume_elsewhere(decode_id, e)
            if resumed is None:
                assert refusal is not None
                await client.end(sse_error(502, refusal))
                return Relayed(self.decode_id, False, notes, Outcome.UPSTREAM, refusal, e.counter.tokens)
            self._r = resumed
            self._legs.append(resumed)
            counter = self._counter = e.counter
            counter.offset = counter.tokens
            self._write = usage_fixer(self._relayed, counter.offset)  # one fixer, with every token streamed so far
            return Relayed(self.decode_id, True, notes)
        counter = self._counter
        if handoff is not None:
            return await self._follow_handoff(client, handoff, counter)
        if client.gone.is_set():
            why = f"client disconnected mid-stream after {counter.tokens} tokens"
            return Relayed(decode_id, False, (), Outcome.CLIENT_GONE, why, counter.output_tokens)
        if counter.done and counter.error is None:
            self.s.health.upstream_ok(decode_id)
            result = Relayed(decode_id, False, (), Outcome.OK, None, counter.output_tokens)
        else:
            why = f"decode {decode_id} stream ended early: {counter.error or 'no [DONE]'}"
            result = Relayed(decode_id, False, (), Outcome.UPSTREAM, why, counter.output_tokens)
        last = self._last
        await client.end(add_streamed_usage(last, counter.offset) if counter.offset and last else last)
        return result

    async def _follow_handoff(self, client: ClientChannel, handoff: bytes, counter: SSETokenCounter) -> Relayed:
        """The source's stream ended with a migration's hand-off event: continue from the target."""
        decode_id = self.decode_id
        target, self.migrating_to = self.migrating_to, None
        if target is None or target not in self.s.instances:
            why = f"decode {decode_id} handed the request over unasked ({handoff[:200].decode(errors='replace')})"
            await client.end(sse_error(502, why))
            return Relayed(decode_id, False, (), Outcome.UPSTREAM, why)
        self.trace.handed_over(decode_id, target, counter.tokens)
        opened, self.resume_leg = self.resume_leg, None
        if opened is None:
            opened = asyncio.ensure_future(self._resume_stream(self.s.instances[target]))
        try:
            self._r = await opened
            self._legs.append(self._r)
        except UpstreamFailure as e:
            why = f"migrated from {decode_id} to {target}, but {target} could not continue it: {e}"
            await client.end(sse_error(502, why))
            return Relayed(decode_id, False, (), Outcome.UPSTREAM, why, counter.tokens)
        self.handed_over = Handover(decode_id, target, self.last_token_at or time.monotonic(), counter.tokens)
        self.s.dispatcher.on_migrated(self.request.id, target, time.monotonic())
        self.decode_id = target
        return Relayed(target, True)

    async def _resume_elsewhere(
        self, failed: str, broken: StreamBroken
    ) -> tuple[tuple[str, ...], str | None, Response | None]:
        """Failure migration: continue a stream whose decode instance died on another one, from the prompt
        plus the text already relayed. Returns the recovery notes, why it could not be (None when it was),
        and the continuation's stream."""
        streamed = broken.counter.tokens
        why = f"decode {failed} failed mid-stream after {streamed} tokens: {broken}"
        transcript = self._transcript
        if transcript is None:
            return (), f"{why} (failure migration is off)", None
        text = transcript.text()
        by_ids = not transcript.chat and prompt_is_token_ids(self.body)
        body, refusal = continuation_body(self.body, transcript.chat, text, streamed, [] if by_ids else None)
        if body is None or transcript.resumable is not None:
            return (), f"{why}; not resumed: {transcript.resumable or refusal}", None
        notes: list[str] = []
        while (moved := self.fail_over(failed, streamed, why)).target is not None:
            target = moved.target
            notes.append(moved.note)
            try:
                await self._under_adapter(target)
                if by_ids:  # a token-id prompt continues with the streamed text as the target tokenizes it
                    body, _ = continuation_body(
                        self.body,
                        False,
                        text,
                        streamed,
                        await tokenize(target, text, self.forward_headers) if text else [],
                    )
                return (
                    tuple(notes),
                    None,
                    await open_decode(target, self.path, orjson.dumps(body), self.leg_headers(target)),
                )
            except UpstreamFailure as e:
                if not e.instance_fault:
                    return tuple(notes), f"{why}; {target.id} refused the continuation: {e}", None
                self.s.health.upstream_failed(target.id)
                failed, why = target.id, f"{why}; then {target.id} could not continue it: {e}"
        return tuple(notes), moved.note, None
