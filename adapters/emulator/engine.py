"""The emulated engine: continuous batching with a waiting queue, KV blocks and preemption, timed by a PerfProfile.

One scheduler task per instance. Each step runs every admitted sequence for one token; its
duration is step_time(batch, resident KV tokens), plus prefill_time(tokens to prefill) when the
step includes new (or preempted, recomputed) prompts, times the fault slowdown. Steps are
scheduled against absolute deadlines on the loop clock, so sleeping late never accumulates drift,
and a step's tokens are released when its deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from adapters.emulator.faults import Faults
from core.perf import PerfProfile


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    id: str
    prompt_tokens: int
    max_tokens: int
    """Tokens to generate before finishing (already drawn when ignore_eos is off)."""
    stop_early: bool = False
    """True when it ends before max_tokens of the client (finish_reason "stop")."""
    priority: int = 0
    arrival: float = 0.0
    needs_prefill: bool = True
    prefill_only: bool = False
    hold_kv: bool = False
    generated: int = 0
    blocks: int = 0
    order: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prev_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    prefilled_tokens: int = 0
    tokens: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    """Generated count after each step; -1 when finished."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    step_deadlines: list[float] | None = None
    """Prescribed release time of each token (only when timing debug is on)."""

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_early else "length"


StepHook = Callable[[list[Sequence], float, int], None]
FinishHook = Callable[[Sequence], None]


class EngineLike(Protocol):
    """What the HTTP layer and the metrics need from an engine (emulated or simulated)."""

    running: list[Sequence]
    preemptions: int
    on_step: StepHook | None

    @property
    def waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    def submit(self, s: Sequence) -> None: ...

    def release_held(self, blocks: int) -> None: ...

    def wake(self) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Engine:
    """Scheduler of one emulated instance."""

    def __init__(
        self,
        profile: PerfProfile,
        faults: Faults,
        *,
        max_num_seqs: int | None = None,
        kv_capacity_tokens: int | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.profile = profile
        self.faults = faults
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.block_size = profile.block_size
        self.total_blocks = max(1, (kv_capacity_tokens or profile.kv_capacity_tokens) // self.block_size)
        self.free_blocks = self.total_blocks
        self.held_blocks = 0
        self.priority_scheduling = priority_scheduling
        self.running: list[Sequence] = []
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._order = itertools.count()
        self._wake = asyncio.Event()
        self.preemptions = 0
        self.on_step: StepHook | None = None
        self.on_finish: FinishHook | None = None
        self.on_prefilled: FinishHook | None = None
        self._task: asyncio.Task[None] | None = None

    # --- queue ---------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._heap) if self.priority_scheduling else len(self._fifo)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def _push(self, s: Sequence, front: bool = False) -> None:
        if self.priority_scheduling:
            heapq.heappush(self._heap, (s.priority, s.arrival, s.order, s))
        elif front:
            self._fifo.appendleft(s)
        else:
            self._fifo.append(s)

    def _peek(self) -> Sequence | None:
        if self.priority_scheduling:
            return self._heap[0][3] if self._heap else None
        return self._fifo[0] if self._fifo else None

    def _pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3] if self.priority_scheduling else self._fifo.popleft()

    def submit(self, s: Sequence) -> None:
        s.order = next(self._order)
        self._push(s)
        self._wake.set()

    def wake(self) -> None:
        """Re-run the scheduler now (faults changed, blocks were freed)."""
        self._wake.set()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- KV holding (prefill side of P/D) ------------------------------------------------------------
    def release_held(self, blocks: int) -> None:
        self.held_blocks -= blocks
        self.free_blocks += blocks
        self._wake.set()

    # --- scheduling --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _admit(self, now: float) -> None:
        while len(self.running) < self.max_num_seqs:
            s = self._peek()
            if s is None:
                return
            need = self.blocks_for(s.prompt_tokens + s.generated + 1)
            if need > self.total_blocks - self.held_blocks:
                self._pop()  # can never fit: fail it rather than block the queue forever
                s.finished_at = now
                s.stop_early = True
                s.max_tokens = s.generated
                self._finish(s, now, error=True)
                continue
            if need > self.free_blocks:
                return
            self._pop()
            s.blocks = need
            self.free_blocks -= need
            if s.admitted_at is None:
                s.admitted_at = now
            self.running.append(s)

    def _ensure_blocks(self) -> None:
        """Every running sequence needs room for its next token; preempt (recompute) until it fits."""
        while True:
            extra = [s for s in self.running if self.blocks_for(s.prompt_tokens + s.generated + 1) > s.blocks]
            if len(extra) <= self.free_blocks:
                for s in extra:
                    s.blocks += 1
                    self.free_blocks -= 1
                return
            victim = max(self.running, key=lambda s: (s.priority, s.arrival, s.order)) if self.priority_scheduling else max(self.running, key=lambda s: s.order)
            self.running.remove(victim)
            self.free_blocks += victim.blocks
            victim.blocks = 0
            victim.needs_prefill = True
            victim.preemptions += 1
            self.preemptions += 1
            self._push(victim, front=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_start = 0.0
        while True:
            now = loop.time()
            self._admit(now)
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                next_start = 0.0  # idle: the next step starts when work arrives
                continue
            if self.faults.hang:
                await asyncio.sleep(0.05)
                continue
            self._ensure_blocks()
            batch = self.running
            kv_tokens = sum(s.prompt_tokens + s.generated for s in batch)
            to_prefill = sum(s.prompt_tokens + s.generated for s in batch if s.needs_prefill)
            dt = self.profile.step_time(len(batch), kv_tokens)
            if to_prefill:
                dt += float(self.profile.prefill_time(to_prefill))
            dt *= self.faults.slowdown
            # Back-to-back steps start at the previous deadline, so waking up late from sleep does
            # not accumulate; only when more than a whole step behind does the schedule slip.
            start = next_start if next_start and now - next_start < dt else now
            deadline = start + dt
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_start = deadline
            self._step_done(deadline)

    def _step_done(self, t: float) -> None:
        finished = []
        for s in self.running:
            if s.needs_prefill:
                s.prefilled_tokens += s.prompt_tokens + s.generated
                s.needs_prefill = False
                if self.on_prefilled is not None:
                    self.on_prefilled(s)
            s.generated += 1
            if s.first_token_at is None:
                s.first_token_at = t
            s.prev_token_at = s.last_token_at
            s.last_token_at = t
            if s.step_deadlines is not None:
                s.step_deadlines.append(t)
            if s.generated >= s.max_tokens or s.prefill_only:
                finished.append(s)
            else:
                s.tokens.put_nowait(s.generated)
        if self.on_step is not None:
            self.on_step(self.running, t, len(self.running))
        if finished:
            gone = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in gone]
            for s in finished:
                self._finish(s, t)

    def _finish(self, s: Sequence, t: float, error: bool = False) -> None:
        s.finished_at = t
        if s.hold_kv and not error:
            self.held_blocks += s.blocks  # the prefill side keeps the KV until it is pulled
        else:
            self.free_blocks += s.blocks
            s.blocks = 0
        if self.on_finish is not None and not error:
            self.on_finish(s)
        s.tokens.put_nowait(s.generated if not error else -2)
        s.tokens.put_nowait(-1)
        s.done.set()
