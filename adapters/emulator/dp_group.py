"""A data-parallel decode group: G engine ranks that step together behind one barrier.

vLLM's data-parallel deployments (MoE attention DP) run G engine ranks behind one API server;
their forward passes are aligned, so every step of the group lasts as long as its slowest rank's
(BF-IO's model, shared/design/papers/bf-io.md: step = C + t_tok · the largest rank's resident
tokens). Each rank is an `engine.Engine` with its own running slots and KV blocks; this group
schedules all of them, sleeps once to the common deadline and closes every rank's step there.

A request names its rank with vLLM's `X-data-parallel-rank` header (`Sequence.dp_rank`); without
one the group picks the rank with the fewest running + waiting requests (lowest index on ties),
as vLLM's internal balancer does from its queue counts. Ranks with nothing to do sit the step
out: their idle time is the imbalance BF-IO minimises. Migration and KV holding for prefill legs
stay with single engines: a group serves decode legs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from adapters.emulator.engine import Engine, SeqHook, StepHook
from adapters.emulator.faults import Faults
from adapters.emulator.loop import RunLoop
from adapters.emulator.sequence import STEP_LOG, Sequence, StepRecord, TokenSink
from adapters.emulator.step_clock import SPIN_MIN_STREAMS, SPIN_S, sleep_until, step_start
from core.perf import PerfProfile


class DataParallelGroup(RunLoop):
    """G lockstep ranks behind the Scheduler surface the HTTP layer and metrics use."""

    task_name = "emulated-dp-group"

    def __init__(self, ranks: int, profile: PerfProfile, faults: Faults, **engine_args: object) -> None:
        if ranks < 2:
            raise ValueError("a data-parallel group needs at least 2 ranks")
        self.ranks = [Engine(profile, faults, **engine_args) for _ in range(ranks)]  # type: ignore[arg-type]
        self._wake = asyncio.Event()
        for r in self.ranks:
            r._wake = self._wake  # any rank's new work wakes the group
        self.faults = faults
        first = self.ranks[0]
        self.clock: Callable[[], float] = first.clock
        self.block_size = first.block_size
        self.total_blocks = sum(r.total_blocks for r in self.ranks)
        self.steps: deque[StepRecord] = deque(maxlen=STEP_LOG)
        """One record per group step: batch and tokens summed, KV tokens of the straggler rank."""
        self.rank_steps: deque[list[tuple[int, int]]] = deque(maxlen=STEP_LOG)
        """Per group step, every busy rank's (batch, KV tokens), in rank order (0, 0 when idle)."""
        self.group_steps = 0
        self.on_step: StepHook | None = None

    # --- the Scheduler surface ----------------------------------------------------------------
    @property
    def running(self) -> list[Sequence]:
        return [s for r in self.ranks for s in r.running]

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.ranks)

    @property
    def free_blocks(self) -> int:
        return sum(r.free_blocks for r in self.ranks)

    @property
    def held_blocks(self) -> int:
        return sum(r.held_blocks for r in self.ranks)

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.ranks)

    @property
    def step_no(self) -> int:
        return self.group_steps

    @property
    def max_num_seqs(self) -> int | None:
        return self.ranks[0].max_num_seqs * len(self.ranks)

    @property
    def max_num_batched_tokens(self) -> int | None:
        return self.ranks[0].max_num_batched_tokens

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    @property
    def flush(self) -> Callable[[list[TokenSink]], None]:
        """Writes a step's prepared tokens at its deadline (every rank uses the HTTP layer's)."""
        return self.ranks[0].flush

    @flush.setter
    def flush(self, writer: Callable[[list[TokenSink]], None]) -> None:
        for r in self.ranks:
            r.flush = writer

    @property
    def on_finish(self) -> SeqHook | None:
        return self.ranks[0].on_finish

    @on_finish.setter
    def on_finish(self, hook: SeqHook | None) -> None:
        for r in self.ranks:
            r.on_finish = hook

    @property
    def on_preempt(self) -> SeqHook | None:
        return self.ranks[0].on_preempt

    @on_preempt.setter
    def on_preempt(self, hook: SeqHook | None) -> None:
        for r in self.ranks:
            r.on_preempt = hook

    def rank_for(self, s: Sequence) -> int:
        """The rank `s` asked for, else the one with the fewest running + waiting requests."""
        if 0 <= s.dp_rank < len(self.ranks):
            return s.dp_rank
        counts = [len(r.running) + r.waiting for r in self.ranks]
        return counts.index(min(counts))

    def submit(self, s: Sequence) -> None:
        s.dp_rank = self.rank_for(s)
        self.ranks[s.dp_rank].submit(s)

    def abort(self, s: Sequence) -> None:
        if 0 <= s.dp_rank < len(self.ranks):
            self.ranks[s.dp_rank].abort(s)

    def release_held(self, blocks: int) -> None:
        raise RuntimeError("a data-parallel group serves decode legs; it holds no prefill KV")

    def kick(self) -> None:
        self._wake.set()

    def rank_load(self) -> list[tuple[int, int]]:
        """(running requests, resident KV tokens) per rank, now."""
        return [(len(r.running), sum(s.computed for s in r.running)) for r in self.ranks]

    # --- the barrier ----------------------------------------------------------------------------
    async def _run(self) -> None:
        prev_end: float | None = None
        while True:
            if self.faults.hang:
                await self.faults.wait_unhung()
                prev_end = None
                continue
            plans = [(r, *r._schedule()) for r in self.ranks]
            busy = [(r, sched, new, admitted) for r, sched, new, admitted, _ in plans if sched]
            if not busy:
                if any(preempted for *_, preempted in plans):
                    continue  # a rank evicted itself; try to readmit at once
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            timed = [(r, sched, new, admitted, *r._duration(sched, new)) for r, sched, new, admitted in busy]
            slowdown = self.faults.slowdown
            dt = max(t[4] for t in timed) * slowdown  # the straggler sets the step for everyone
            start, kind = step_start(prev_end, self.clock(), dt)
            deadline = start + dt
            opened = [
                (r, sched, new, r._open_step(sched, new, admitted, start, deadline), kv, chunks)
                for r, sched, new, admitted, _, kv, chunks in timed
            ]
            streams = sum(1 for *_, sampled, _, _ in opened for s in sampled if s.sink is not None)
            await sleep_until(self.clock, deadline, SPIN_S if streams >= SPIN_MIN_STREAMS else 0.0)
            woke = self.clock()
            records = [
                r._close_step(sched, new, sampled, start, deadline, kv, chunks, slowdown, kind, woke)
                for r, sched, new, sampled, kv, chunks in opened
            ]
            self.group_steps += 1
            per_rank = {id(r): (rec.batch, rec.kv_tokens) for (r, *_), rec in zip(opened, records, strict=True)}
            self.rank_steps.append([per_rank.get(id(r), (0, 0)) for r in self.ranks])
            record = StepRecord(
                self.group_steps,
                start,
                deadline,
                sum(x.batch for x in records),
                max(x.kv_tokens for x in records),
                sum(x.tokens for x in records),
                [c for x in records for c in x.chunks],
                sum(x.sampled for x in records),
                slowdown,
                kind,
                woke,
                max(x.released for x in records),
            )
            self.steps.append(record)
            if self.on_step is not None:
                self.on_step(record, [s for *_, sampled, _, _ in opened for s in sampled])
            prev_end = deadline
