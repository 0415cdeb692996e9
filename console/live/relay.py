"""A live request's decode stream relayed to its client: progress, migration hand-offs, failure migration."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from adapters.http.upstream import Response
from adapters.vllm.forward import StreamBroken, UpstreamFailure, open_decode, relay_stream, tokenize
from adapters.vllm.pd_protocol import StreamTranscript, add_streamed_usage, continuation_body, prompt_is_token_ids
from console.gateway.errors import sse_error
from console.live.channel import ClientChannel, recording, usage_fixer
from console.live.request_host import RequestHost

if TYPE_CHECKING:
    from console.live.request import LiveRequest

PROGRESS_EVERY_S = 0.05
"""How often a streaming request's token count is passed to the dispatcher (at most)."""


async def relay(live: LiveRequest, c: RequestHost, client: ClientChannel, r: Any, decode_id: str) -> None:
    """Relay the decode stream to the client; follow the request when its instance migrates it."""
    progress = c.dispatcher.on_progress
    rid = live.request.id
    next_report = 0.0

    def on_tokens(n: int) -> None:
        # The dispatcher learns this request's progress at most every PROGRESS_EVERY_S: its
        # decode-rate estimate needs no more, and a busy stream sends tens of tokens a second.
        nonlocal next_report
        now = time.monotonic()
        if live.first_token_at is None:
            live.first_token_at = now
        if live.handed_over is not None:
            c.migration_done(live, *live.handed_over, now)
            live.handed_over = None
            live.trace.migrated(now)
        live.last_token_at = now
        if now >= next_report:
            next_report = now + PROGRESS_EVERY_S
            progress(rid, n, now)

    counter = None
    last = b""
    relayed: Callable[[bytes], Awaitable[None]] = client.write
    transcript = (
        StreamTranscript(live.path.endswith("chat/completions")) if c.config.failure_migration_attempts else None
    )
    if transcript is not None:
        relayed = recording(relayed, transcript.add)
    write = relayed

    async with contextlib.AsyncExitStack() as legs:
        while True:
            try:
                counter, handoff, last = await relay_stream(r, write, on_tokens, client.gone, counter)
            except StreamBroken as e:
                c.upstream_failed(decode_id)
                resumed = await _resume_elsewhere(live, c, decode_id, e, transcript)
                if resumed is None:
                    live.output_tokens = e.counter.tokens
                    await client.end(sse_error(502, live.reason or str(e)))
                    return
                r, decode_id = resumed
                legs.callback(r.release)
                counter = e.counter
                counter.offset = counter.tokens
                write = usage_fixer(relayed, counter.offset)  # one fixer, with every token streamed so far
                continue
            if handoff is None:
                break
            target, live.migrating_to = live.migrating_to, None
            if target is None or target not in c.instances:
                live.reason = (
                    f"decode {decode_id} handed the request over unasked ({handoff[:200].decode(errors='replace')})"
                )
                await client.end(sse_error(502, live.reason))
                return
            live.trace.handed_over(decode_id, target, counter.tokens)
            opened, live.resume_leg = live.resume_leg, None
            if opened is None:
                opened = asyncio.ensure_future(live.resume_stream(c.instances[target]))
            try:
                r = await opened
                legs.callback(r.release)
            except UpstreamFailure as e:
                live.output_tokens = counter.tokens
                live.reason = f"migrated from {decode_id} to {target}, but {target} could not continue it: {e}"
                await client.end(sse_error(502, live.reason))
                return
            live.handed_over = (decode_id, target, live.last_token_at or time.monotonic(), counter.tokens)
            c.dispatcher.on_migrated(rid, target, time.monotonic())
            decode_id = live.decode_instance = target
    live.output_tokens = counter.output_tokens
    if client.gone.is_set():
        live.reason = f"client disconnected mid-stream after {counter.tokens} tokens"
        return
    if counter.done and counter.error is None:
        live.ok = True
        c.upstream_ok(decode_id)
    else:
        live.reason = f"decode {decode_id} stream ended early: {counter.error or 'no [DONE]'}"
    await client.end(add_streamed_usage(last, counter.offset) if counter.offset and last else last)


async def _resume_elsewhere(
    live: LiveRequest, c: RequestHost, failed: str, broken: StreamBroken, transcript: StreamTranscript | None
) -> tuple[Response, str] | None:
    """Failure migration: continue a stream whose decode instance died on another one, from
    the prompt plus the text already relayed; None (reason set) when it cannot be."""
    streamed = broken.counter.tokens
    why = f"decode {failed} failed mid-stream after {streamed} tokens: {broken}"
    if transcript is None:
        live.reason = f"{why} (failure migration is off)"
        return None
    text = transcript.text()
    by_ids = not transcript.chat and prompt_is_token_ids(live.body)
    body, refusal = continuation_body(live.body, transcript.chat, text, streamed, [] if by_ids else None)
    if body is None or transcript.resumable is not None:
        live.reason = f"{why}; not resumed: {transcript.resumable or refusal}"
        return None
    while (target := live.fail_over(c, failed, streamed, why)) is not None:
        try:
            if by_ids:  # a token-id prompt continues with the streamed text as the target tokenizes it
                body, _ = continuation_body(
                    live.body,
                    False,
                    text,
                    streamed,
                    await tokenize(target, text, live.forward_headers) if text else [],
                )
            return await open_decode(target, live.path, orjson.dumps(body), live.leg_headers(c, target)), target.id
        except UpstreamFailure as e:
            if not e.instance_fault:
                live.reason = f"{why}; {target.id} refused the continuation: {e}"
                return None
            c.upstream_failed(target.id)
            failed, why = target.id, f"{why}; then {target.id} could not continue it: {e}"
    return None
