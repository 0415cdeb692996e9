"""The simulator as a live backend: core.sim.cluster's instance model paced to wall-clock, behind vLLM's HTTP API.

Each simulated instance keeps the discrete-event simulator's semantics: prompts are prefilled
FIFO one at a time for profile.prefill_time(l) (the prefill produces the first token), and
decoding is processor sharing with the profile's TPS(N) curve (core.sim.cluster.decode_ps). Time is
`time.monotonic()`, so a live console routes to instances that behave like the ones
`sibyl-console sim` simulates. Decode progress is published to the streams every `tick_s`; a
stream that earned several tokens within one tick gets them together.

It implements the emulator's `Scheduler` surface, so `EmulatedInstance` serves it with the same
HTTP API, P/D legs, metrics and faults as the continuous-batching engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

from adapters.emulator.engine import release_all
from adapters.emulator.faults import Faults
from adapters.emulator.loop import RunLoop
from adapters.emulator.sequence import STEP_LOG, Sequence, StepRecord, TokenSink
from adapters.emulator.settings import InstanceSettings
from core.perf import PerfProfile
from core.sim.cluster.decode_ps import PSDecodeInstance


class SimEngine(RunLoop):
    """One simulated instance: FIFO prefill, then processor-sharing decode."""

    task_name = "sim-engine"

    def __init__(
        self, profile: PerfProfile, faults: Faults, *, kv_capacity_tokens: int | None = None, tick_s: float = 0.01
    ) -> None:
        self.profile = profile
        self.faults = faults
        self.tick_s = tick_s
        self.clock: Callable[[], float] = time.monotonic
        self.block_size = profile.block_size
        self.total_blocks = max(1, (kv_capacity_tokens or profile.kv_capacity_tokens) // self.block_size)
        self.held_blocks = 0
        self.running: list[Sequence] = []
        """Sequences decoding (processor sharing)."""
        self.preemptions = 0
        """Always 0: the processor-sharing model has no KV limit to preempt on."""
        self.steps: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self.step_no = 0
        self.on_step: Callable[[StepRecord, list[Sequence]], None] | None = None
        self.on_finish: Callable[[Sequence], None] | None = None
        self.on_preempt: Callable[[Sequence], None] | None = None
        self.flush: Callable[[list[TokenSink]], None] = release_all
        self.decoder = PSDecodeInstance(profile)
        self._queue: deque[Sequence] = deque()
        self._prefilling: tuple[Sequence, float, float] | None = None
        """The sequence being prefilled, with its start and end times."""
        self._key_of: dict[Sequence, int] = {}
        self._by_key: dict[int, Sequence] = {}
        self._base: dict[int, int] = {}
        """Tokens a sequence had when it entered decoding."""
        self._keys = itertools.count()
        self._wake = asyncio.Event()

    # --- what the HTTP layer reads ----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def kv_usage(self) -> float:
        resident = sum(self.blocks_for(s.context) for s in self.running)
        if self._prefilling is not None:
            resident += self.blocks_for(self._prefilling[0].context)
        return min(1.0, (resident + self.held_blocks) / self.total_blocks)

    @property
    def free_blocks(self) -> int:
        return max(0, self.total_blocks - round(self.kv_usage * self.total_blocks))

    max_num_seqs = None
    """Processor sharing admits every sequence at once."""
    max_num_batched_tokens = None
    """Prompts are prefilled whole, one at a time."""

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- requests ---------------------------------------------------------------------------------
    def submit(self, s: Sequence) -> None:
        if s.prefilling:
            s.in_waiting = True
            self._queue.append(s)
        else:  # the decode leg of P/D: its prompt's KV was pulled
            self._start_decode(s, self.clock())
        self._wake.set()

    def abort(self, s: Sequence) -> None:
        if s.finished:
            return
        now = self.clock()
        if s.in_waiting:
            s.in_waiting = False
            self._queue.remove(s)
        if self._prefilling is not None and self._prefilling[0] is s:
            self._prefilling = None
        key = self._key_of.pop(s, None)
        if key is not None:
            self.decoder.remove(key, now)
            del self._by_key[key], self._base[key]
            self.running.remove(s)
            s.in_running = False
        self._finish(s, "abort", now)
        self._wake.set()

    def release_held(self, blocks: int) -> None:
        self.held_blocks = max(0, self.held_blocks - blocks)
        self._wake.set()

    def kick(self) -> None:
        self._wake.set()

    # --- lifecycle --------------------------------------------------------------------------------

    # --- the model ----------------------------------------------------------------------------------
    def _start_decode(self, s: Sequence, now: float) -> None:
        if s.admitted_at is None:
            s.admitted_at = now
        s.prefilling = False
        s.computed = s.context
        if s.generated >= s.max_tokens:
            self._finish(s, s.done_reason, now)
            return
        key = next(self._keys)
        self._key_of[s], self._by_key[key], self._base[key] = key, s, s.generated
        s.in_running = True
        self.running.append(s)
        self.decoder.admit(key, s.max_tokens - s.generated, now)

    def _finish(self, s: Sequence, reason: str, t: float) -> None:
        s.finish_reason = reason
        s.finished_at = t
        if s.hold_kv and reason == "length":
            s.blocks = self.blocks_for(s.prompt_tokens)
            self.held_blocks += s.blocks  # the prefill side keeps the KV until it is pulled
        if self.on_finish is not None:
            self.on_finish(s)
        if s.sink is not None:
            s.sink.close()
        s.done.set()

    def _emit(self, sampled: list[Sequence], start: float, t: float, batch: int, tokens: int) -> None:
        """Each sequence in `sampled` produced its next token at `t`: stream it, log the step."""
        self.step_no += 1
        sinks = []
        for s in sampled:
            if s.sink is not None:
                last = s.prefill_only or s.generated + 1 >= s.max_tokens
                s.sink.prepare(s.generated, s.done_reason if last else None, self.step_no, t)
                sinks.append(s.sink)
            s.generated += 1
            s.prev_token_at, s.last_token_at = s.last_token_at, t
            if s.first_token_at is None:
                s.first_token_at = t
        self.flush(sinks)
        kv = sum(s.context for s in self.running)
        record = StepRecord(
            self.step_no, start, t, batch, kv, tokens, [], len(sampled), self.faults.slowdown, "chain", t, self.clock()
        )
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record, sampled)

    def _advance_prefill(self, now: float) -> float:
        """Finish the current prefill if due, start the next; return when the current one ends."""
        while True:
            if self._prefilling is not None:
                s, start, end = self._prefilling
                if end > now:
                    return end
                self._prefilling = None
                s.local_prefill_tokens += s.context
                self._emit([s], start, end, 1, s.context)  # the prefill produces the first token
                if s.prefill_only or s.generated >= s.max_tokens:
                    self._finish(s, s.done_reason, end)
                else:
                    self._start_decode(s, end)
            if not self._queue:
                return math.inf
            s = self._queue.popleft()
            s.in_waiting = False
            if s.admitted_at is None:
                s.admitted_at = now
            duration = float(self.profile.prefill_time(s.context)) * self.faults.slowdown
            self._prefilling = (s, now, now + duration)

    def _publish(self, now: float) -> None:
        """Give every stream the tokens it has generated by `now`; finish the ones that are done."""
        _, done = self.decoder.fire(now)
        keys, progress = self.decoder.progress(now)
        earned: dict[Sequence, int] = {}
        for key, gen in zip(keys, progress, strict=True):
            s = self._by_key[key]
            total = min(s.max_tokens, self._base[key] + int(gen + 1e-9))
            if total > s.generated:
                earned[s] = total - s.generated
        for key in done:
            s = self._by_key.pop(key)
            del self._base[key], self._key_of[s]
            earned[s] = s.max_tokens - s.generated
        batch = len(self.running)
        for k in range(1, max(earned.values(), default=0) + 1):
            self._emit(
                [s for s, n in earned.items() if n >= k], now, now, batch, sum(1 for n in earned.values() if n >= k)
            )
        finished = [s for s in earned if s.generated >= s.max_tokens]
        for s in finished:
            s.in_running = False
        if finished:
            self.running = [s for s in self.running if s.in_running]
            for s in finished:
                self._finish(s, s.done_reason, now)

    async def _run(self) -> None:
        while True:
            if self.faults.hang:
                await self.faults.wait_unhung()
                continue
            now = self.clock()
            prefill_end = self._advance_prefill(now)
            self._publish(now)
            nxt = min(prefill_end, self.decoder.next_event_time())
            if self.running:
                nxt = min(nxt, now + self.tick_s)
            self._wake.clear()
            if math.isinf(nxt):
                await self._wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, nxt - self.clock()))


def sim_scheduler(s: InstanceSettings, faults: Faults) -> SimEngine:
    """`SchedulerFactory` for EmulatedInstance: the simulator's instance model."""
    return SimEngine(s.profile, faults, kv_capacity_tokens=s.kv_tokens)
