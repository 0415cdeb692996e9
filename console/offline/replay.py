"""Open-loop trace replay against an OpenAI-compatible endpoint, with client-side latencies.

Each trace row becomes a streaming `/v1/completions` request whose prompt is a token-id list of
the row's prompt length and whose output is forced with `max_tokens` + `ignore_eos`; requests are
sent at their arrival times (÷ speed) whatever happened to earlier ones, up to an optional
concurrency cap. Pause/resume shift the schedule; stop ends sending and lets in-flight requests
finish (bounded). Every result goes to a callback (the run recorder).

Prompts keep a trace's prefix structure when it has one (Mooncake `hash_ids`): every hash block
becomes a fixed block of `hash_block_tokens` token ids seeded by (prompt seed, lap)
(core.traces.prompts), so rows sharing leading hash ids share that prefix on the server, while a
new prompt seed (a new replay) or a new lap of a looped replay shares nothing with the last.
Other rows get fresh ids of their own. A session id per row (core.traces.sessions) is sent as
the `X-Session-ID` header, the first key vLLM's router hashes for `consistent_hash`; the body's
`user` is left alone, because the console's gateway reads it as the fair-queueing tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import orjson

from adapters.vllm.pd_protocol import SSETokenCounter
from core.slo import percentile
from core.traces.prompts import DEFAULT_VOCAB, NATIVE_BLOCK_TOKENS, hash_prompt, scaled_length

if TYPE_CHECKING:
    from core.traces.model import Trace

ResultSink = Callable[[dict[str, Any]], None]

REUSE_IDLE_S = 4.0
"""A pooled connection idle longer than this is closed instead of reused: under the 5 s after which uvicorn (vLLM's
API server, and the default of many others) closes an idle keep-alive connection, so that no request is written into
that close (aiohttp takes the oldest idle connection first, the one nearest the server's limit)."""


@dataclass
class ReplayStats:
    total: int
    sent: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    laps: int = 0
    recent_ttft: deque[float] = field(default_factory=lambda: deque(maxlen=500))
    recent_tpot: deque[float] = field(default_factory=lambda: deque(maxlen=500))

    def snapshot(self) -> dict[str, Any]:
        import numpy as np

        ttft, tpot = np.array(self.recent_ttft), np.array(self.recent_tpot)
        return {
            "total": self.total,
            "sent": self.sent,
            "done": self.done,
            "failed": self.failed,
            "in_flight": self.in_flight,
            "laps": self.laps,
            "ttft_p50": percentile(ttft, 50) if len(ttft) else None,
            "ttft_p99": percentile(ttft, 99) if len(ttft) else None,
            "tpot_p50": percentile(tpot, 50) if len(tpot) else None,
            "tpot_p99": percentile(tpot, 99) if len(tpot) else None,
        }


class _UsageCounter(SSETokenCounter):
    """An SSE token counter that also keeps the final usage's `prompt_tokens_details.cached_tokens`."""

    cached_tokens: int | None = None

    def _read_usage(self, event: bytes) -> None:
        super()._read_usage(event)
        try:
            payload = orjson.loads(event[5:]) if event.startswith(b"data:") else None
        except orjson.JSONDecodeError:
            return
        usage = payload.get("usage") if isinstance(payload, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            self.cached_tokens = details["cached_tokens"]


def prompt_ids(n: int, *salt: int) -> list[int]:
    """A token-id prompt of length n: ids in [1, 1000] drawn from a generator seeded by `salt`, so
    prompts of different salts share no prefix a server's prefix cache could reuse."""
    ids: list[int] = np.random.default_rng(list(salt)).integers(1, 1001, n).tolist()
    return ids


class Replayer:
    """Sends a trace's requests on schedule; pause, resume and stop are safe from any task."""

    def __init__(
        self,
        arrivals: list[float],
        prompt_tokens: list[int],
        output_tokens: list[int],
        url: str,
        *,
        model: str | None = None,
        speed: float = 1.0,
        max_concurrency: int | None = None,
        max_context: int | None = None,
        loop: bool = False,
        on_result: ResultSink | None = None,
        headers: dict[str, str] | None = None,
        prompt_seed: int | None = None,
        id_prefix: str = "replay",
        hash_ids: list[list[int]] | None = None,
        sessions: list[int] | None = None,
        hash_block_tokens: int = NATIVE_BLOCK_TOKENS,
        vocab_size: int = DEFAULT_VOCAB,
        lora: list[str | None] | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        if hash_block_tokens < 1:
            raise ValueError("hash_block_tokens must be >= 1")
        for name, column in (("hash_ids", hash_ids), ("sessions", sessions), ("lora", lora)):
            if column is not None and len(column) != len(arrivals):
                raise ValueError(f"{name} has {len(column)} rows, arrivals has {len(arrivals)}")
        self.arrivals, self.prompts, self.outputs = arrivals, prompt_tokens, output_tokens
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.speed = speed
        self.max_context = max_context
        self.loop = loop
        self.on_result = on_result
        self.headers = headers or {}
        self.prompt_seed = secrets.randbits(32) if prompt_seed is None else prompt_seed
        """Seeds every prompt (with the lap and the row): a fresh one per replay unless given."""
        self.id_prefix = id_prefix
        """Request ids are `<id_prefix>-<lap>-<row>` (the replay command uses its run id)."""
        self.hash_ids = hash_ids
        """Prefix-block hashes per row (Mooncake), or None: every prompt fresh."""
        self.sessions = sessions
        """Session id per row, sent as `X-Session-ID: <id_prefix>-<lap>-s<session>`, or None."""
        self.hash_block_tokens = hash_block_tokens
        """Tokens per hash block; prompt lengths scale by hash_block_tokens / 512 with hash ids."""
        self.vocab_size = vocab_size
        self.lora = lora
        """The LoRA adapter per row, sent as the request's `model` (None: `model`), or None."""
        self.stats = ReplayStats(total=len(arrivals))
        self._cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._running = asyncio.Event()
        self._running.set()
        self._stopped = False
        self._paused_at: float | None = None
        self._shift = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self.status = "running"

    @classmethod
    def from_trace(
        cls, trace: Trace, url: str, *, hash_block_tokens: int = NATIVE_BLOCK_TOKENS, prefix: bool = True, **kwargs: Any
    ) -> Replayer:
        """A replayer of `trace` that keeps its prefix structure (hash ids and derived sessions)
        unless `prefix` is False; `kwargs` as for the constructor."""
        hashed = prefix and trace.hash_ids is not None
        if hashed and trace.session is None:
            trace = trace.with_sessions()
        return cls(
            trace.arrivals.tolist(),
            trace.prompt_tokens.tolist(),
            trace.output_tokens.tolist(),
            url,
            hash_ids=trace.hash_ids if hashed else None,
            sessions=trace.session.tolist() if hashed and trace.session is not None else None,
            hash_block_tokens=hash_block_tokens,
            lora=trace.lora,
            **kwargs,
        )

    # --- control -----------------------------------------------------------------------------------
    def pause(self) -> None:
        if self._running.is_set() and not self._stopped:
            self._running.clear()
            self._paused_at = time.monotonic()
            self.status = "paused"

    def resume(self) -> None:
        if not self._running.is_set():
            if self._paused_at is not None:
                self._shift += time.monotonic() - self._paused_at
            self._paused_at = None
            self._running.set()
            self.status = "running"

    def stop(self) -> None:
        self._stopped = True
        self._running.set()
        self.status = "stopping"

    def snapshot(self) -> dict[str, Any]:
        return {"status": self.status, "paused": self.status == "paused", **self.stats.snapshot()}

    # --- sending ----------------------------------------------------------------------------------------
    def _clip(self, prompt: int, out: int) -> tuple[int, int]:
        if self.max_context is None:
            return prompt, out
        out = max(1, min(out, self.max_context - 1))
        return max(1, min(prompt, self.max_context - out)), out

    async def run(self, drain_timeout_s: float = 30.0) -> None:
        """Send everything (again and again with `loop`), then wait for in-flight requests (bounded)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=REUSE_IDLE_S)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            try:
                lap = 0
                while not self._stopped:
                    await self._lap(session, lap)
                    lap += 1
                    self.stats.laps = lap
                    if not self.loop:
                        break
            finally:
                self.status = "draining"
                if self._tasks:
                    # A finished trace waits for its requests; a stopped one only for drain_timeout_s.
                    _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout_s if self._stopped else None)
                    for t in pending:
                        t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.gather(*pending, return_exceptions=True)
                self.status = "stopped" if self._stopped else "finished"

    async def _lap(self, session: aiohttp.ClientSession, lap: int) -> None:
        if not self.arrivals:
            return
        start = time.monotonic()
        self._shift = 0.0
        first = self.arrivals[0]
        for i, arrival in enumerate(self.arrivals):
            if self._stopped:
                return
            await self._running.wait()
            if self._stopped:
                return
            due = start + self._shift + (arrival - first) / self.speed
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                await self._running.wait()
            if self._cap is not None:
                await self._cap.acquire()
            task = asyncio.create_task(self._send(session, i, lap, due - start))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def request_prompt(self, i: int, lap: int = 0) -> tuple[Any, int]:
        """(prompt token ids, max_tokens) of row `i` in lap `lap`: the row's hash blocks (its
        length scaled to hash_block_tokens per 512-token block, then clipped to the context)
        or fresh ids; a list or an int64 array."""
        ids = self.hash_ids[i] if self.hash_ids is not None else None
        length = self.prompts[i] if self.hash_ids is None else scaled_length(self.prompts[i], self.hash_block_tokens)
        prompt, out = self._clip(length, self.outputs[i])
        if not ids:
            return prompt_ids(prompt, self.prompt_seed, lap, i), out
        seed = (self.prompt_seed, lap)
        return hash_prompt(
            ids, prompt, seed=seed, row=i, block_tokens=self.hash_block_tokens, vocab_size=self.vocab_size
        ), out

    async def _send(self, session: aiohttp.ClientSession, i: int, lap: int, scheduled: float) -> None:
        ids, out = self.request_prompt(i, lap)
        prompt = len(ids)
        body: dict[str, Any] = {
            "prompt": ids,
            "max_tokens": out,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        adapter = self.lora[i] if self.lora is not None else None
        if adapter or self.model:
            body["model"] = adapter or self.model
        rid = f"{self.id_prefix}-{lap}-{i}"
        headers = {**self.headers, "Content-Type": "application/json", "X-Request-Id": rid}
        if self.sessions is not None:
            headers["X-Session-ID"] = f"{self.id_prefix}-{lap}-s{self.sessions[i]}"
        st = self.stats
        st.sent += 1
        st.in_flight += 1
        sent = time.monotonic()
        first: float | None = None
        counter = _UsageCounter()
        status, reason = "failed", None
        try:
            async with session.post(
                self.url, data=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers=headers
            ) as r:
                if r.status != 200:
                    reason = f"HTTP {r.status}: {(await r.read())[:200].decode(errors='replace')}"
                else:
                    async for chunk in r.content.iter_any():
                        if counter.feed(chunk) and first is None:
                            first = time.monotonic()
                    if counter.done and counter.error is None:
                        status = "ok"
                    else:
                        reason = f"stream ended early: {counter.error or 'no [DONE]'}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            reason = f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            reason = "cancelled at shutdown"
        finally:
            st.in_flight -= 1
            if self._cap is not None:
                self._cap.release()
        finish = time.monotonic()
        n = counter.output_tokens
        ttft = (first - sent) if status == "ok" and first is not None else None
        tpot = ((finish - first) / (n - 1) if n > 1 else 0.0) if status == "ok" and first is not None else None
        if status == "ok":
            st.done += 1
            if ttft is not None:
                st.recent_ttft.append(ttft)
            if tpot is not None:
                st.recent_tpot.append(tpot)
        else:
            st.failed += 1
        if self.on_result is not None:
            self.on_result(
                {
                    "request_id": rid,
                    "arrival": scheduled,
                    "prompt_tokens": prompt,
                    "output_tokens": n if status == "ok" else None,
                    "max_tokens": out,
                    "first_token": None if first is None else first - sent + scheduled,
                    "finish": finish - sent + scheduled,
                    "ttft": ttft,
                    "tpot": tpot,
                    "e2e": finish - sent if status == "ok" else None,
                    "status": status,
                    "reason": reason,
                    "cached_tokens": counter.cached_tokens,
                }
            )
