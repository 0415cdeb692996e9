"""The simulator as a live backend: core.sim's instance models paced to wall-clock, behind vLLM's HTTP API.

Each simulated instance keeps the discrete-event simulator's semantics: prompts are prefilled
FIFO one at a time for profile.prefill_time(l) (the prefill produces the first token), and
decoding is processor sharing with the profile's TPS(N) curve (core.sim.decode_ps). Virtual time is
the event loop's clock (× speed), so a live console routes to instances that behave exactly like
the ones `sibyl-console sim` simulates. Progress is published to the HTTP streams every `tick_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections import deque

from adapters.emulator.engine import Sequence, StepHook
from adapters.emulator.faults import Faults
from core.perf import PerfProfile
from core.sim.decode_ps import PSDecodeInstance


class SimEngine:
    """One simulated instance: FIFO prefill, then processor-sharing decode."""

    def __init__(self, profile: PerfProfile, faults: Faults, *, tick_s: float = 0.01, speed: float = 1.0) -> None:
        self.profile = profile
        self.faults = faults
        self.tick_s = tick_s
        self.speed = speed
        self.decoder = PSDecodeInstance(profile)
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.on_step: StepHook | None = None
        self._prefill_queue: deque[Sequence] = deque()
        self._prefilling: tuple[Sequence, float] | None = None
        self._by_key: dict[int, Sequence] = {}
        self._keys = itertools.count()
        self._base: dict[int, int] = {}
        """Tokens a sequence had when it entered decoding (1 when its prefill produced the first)."""
        self.held_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    # --- what the HTTP layer reads ----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._prefill_queue)

    @property
    def kv_usage(self) -> float:
        resident = sum(s.prompt_tokens + s.generated for s in self.running) + self.held_tokens
        return min(1.0, resident / self.profile.kv_capacity_tokens)

    def submit(self, s: Sequence) -> None:
        if s.needs_prefill:
            self._prefill_queue.append(s)
        else:
            self._start_decode(s, self._now())
        self._wake.set()

    def release_held(self, blocks: int) -> None:
        self.held_tokens = max(0, self.held_tokens - blocks * self.profile.block_size)

    def wake(self) -> None:
        self._wake.set()

    # --- virtual time -----------------------------------------------------------------------------
    def _now(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) * self.speed

    def _wall(self, virtual: float) -> float:
        return self._t0 + virtual / self.speed

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- the model ----------------------------------------------------------------------------------
    def _start_decode(self, s: Sequence, now: float) -> None:
        key = next(self._keys)
        self._by_key[key] = s
        self._base[key] = s.generated
        if s.admitted_at is None:
            s.admitted_at = self._wall(now)
        remaining = s.max_tokens - s.generated
        if remaining <= 0:
            self._finish(s, now)
            return
        self.running.append(s)
        self.decoder.admit(key, remaining, now)

    def _finish(self, s: Sequence, now: float) -> None:
        t = self._wall(now)
        s.finished_at = t
        if s.first_token_at is None:
            s.first_token_at = t
        s.last_token_at = t
        if s.hold_kv:
            self.held_tokens += s.prompt_tokens
            s.blocks = math.ceil(s.prompt_tokens / self.profile.block_size)
        s.tokens.put_nowait(s.generated)
        s.tokens.put_nowait(-1)
        s.done.set()

    def _advance_prefill(self, now: float) -> float:
        """Finish the current prefill if due, start the next; returns when the current one ends."""
        while True:
            if self._prefilling is not None:
                s, end = self._prefilling
                if end > now:
                    return end
                self._prefilling = None
                s.needs_prefill = False
                s.prefilled_tokens += s.prompt_tokens + s.generated
                s.generated += 1  # the prefill step produces the first token
                t = self._wall(end)
                s.first_token_at = s.first_token_at or t
                s.prev_token_at, s.last_token_at = s.last_token_at, t
                if s.prefill_only or s.generated >= s.max_tokens:
                    self._finish(s, end)
                else:
                    s.tokens.put_nowait(s.generated)
                    self._start_decode(s, end)
            if not self._prefill_queue:
                return math.inf
            s = self._prefill_queue.popleft()
            s.admitted_at = s.admitted_at or self._wall(now)
            duration = float(self.profile.prefill_time(s.prompt_tokens + s.generated)) * self.faults.slowdown
            self._prefilling = (s, now + duration)

    def _publish(self, now: float) -> None:
        """Give every stream the tokens it has generated by `now`; finish the ones that are done."""
        _, done = self.decoder.fire(now)
        keys, progress = self.decoder.progress(now)
        t = self._wall(now)
        stepped: list[Sequence] = []
        for key, gen in zip(keys, progress, strict=True):
            s = self._by_key[key]
            total = min(s.max_tokens, self._base[key] + int(gen + 1e-9))
            if total > s.generated:
                s.generated = total
                s.prev_token_at, s.last_token_at = s.last_token_at, t
                s.first_token_at = s.first_token_at or t
                s.tokens.put_nowait(total)
                stepped.append(s)
        for key in done:
            s = self._by_key.pop(key)
            del self._base[key]
            s.generated = s.max_tokens
            self.running.remove(s)
            self._finish(s, now)
            stepped.append(s)
        if stepped and self.on_step is not None:
            self.on_step(stepped, t, len(stepped))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = self._now()
            prefill_end = self._advance_prefill(now)
            self._publish(now)
            nxt = min(prefill_end, self.decoder.next_event_time())
            if self.running:
                nxt = min(nxt, now + self.tick_s * self.speed)
            self._wake.clear()
            if math.isinf(nxt):
                await self._wake.wait()
                continue
            delay = max(0.0, self._wall(nxt) - loop.time())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
