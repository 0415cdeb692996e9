"""Deterministic discrete-event simulation of a P/D cluster driving the same Dispatcher as live.

Events are ordered by (time, kind, sequence). Arrivals are merged from the sorted trace rather
than heaped. Prefill instances serve their queue FIFO, one prompt at a time, for
profile.prefill_time(l); the KV transfer follows; decode runs in processor-sharing or
iteration-level mode. Nothing ticks per token: every instance jumps from event to event.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from core.dispatch import Dispatcher
from core.errors import NoCapacityError
from core.perf import PerfProfile
from core.sim.decode_iter import IterationDecodeInstance
from core.sim.decode_ps import PSDecodeInstance
from core.types import PolicyKind, Request, Role

Mode = Literal["ps", "iteration"]

# Event kinds, in the order they run when times tie.
_DECODE, _PREFILL_DONE, _DECODE_START, _SWAP = 0, 1, 2, 3


class DecodeModel(Protocol):
    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None: ...
    def next_event_time(self) -> float: ...
    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]: ...
    def progress(self, now: float) -> tuple[list[int], list[float]]: ...


class _PSAdapter(PSDecodeInstance):
    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None:  # type: ignore[override]
        super().admit(req, output_tokens, now)


@dataclass(frozen=True)
class ScheduledSwap:
    """A policy swap the simulation applies at a given virtual time."""

    time: float
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    kind: PolicyKind = PolicyKind.ROUTING


@dataclass
class SimResult:
    """Per-request timelines (arrays indexed like the trace) and run-level facts."""

    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefill_instance: np.ndarray
    decode_instance: np.ndarray
    prefill_start: np.ndarray
    prefill_end: np.ndarray
    decode_start: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    ok: np.ndarray
    instance_ids: list[str]
    events: int
    preemptions: int
    assignment_ratio: float
    shadow_ratios: dict[str, float]
    policy_events: list[Any]


class Simulation:
    """One simulated run of a trace on an nP·mD cluster under the dispatcher's policies."""

    def __init__(
        self,
        *,
        arrivals: np.ndarray,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        profile: PerfProfile,
        n_prefill: int,
        n_decode: int,
        dispatcher: Dispatcher,
        mode: Mode = "ps",
        swaps: Sequence[ScheduledSwap] = (),
    ) -> None:
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
        if not np.all(np.diff(arrivals) >= 0):
            raise ValueError("arrivals must be sorted")
        self.arrival = np.asarray(arrivals, dtype=float)
        self.prompt = np.asarray(prompt_tokens, dtype=np.int64)
        self.out = np.maximum(np.asarray(output_tokens, dtype=np.int64), 1)
        self.profile = profile
        self.mode = mode
        self.dispatcher = dispatcher
        self.swaps = sorted(swaps, key=lambda s: s.time)
        self.prefill_ids = [f"p{i}" for i in range(n_prefill)]
        self.decode_ids = [f"d{i}" for i in range(n_decode)]
        for pid in self.prefill_ids:
            dispatcher.add_instance(pid, Role.PREFILL)
        for did in self.decode_ids:
            dispatcher.add_instance(did, Role.DECODE)
        make: Callable[[PerfProfile], DecodeModel] = (
            _PSAdapter if mode == "ps" else IterationDecodeInstance
        )
        self.decoders: list[DecodeModel] = [make(profile) for _ in range(n_decode)]
        self._dec_index = {dispatcher.index_of(d): k for k, d in enumerate(self.decode_ids)}
        self._pre_index = {dispatcher.index_of(p): k for k, p in enumerate(self.prefill_ids)}
        self.queues: list[deque[int]] = [deque() for _ in range(n_prefill)]
        self.busy = [False] * n_prefill
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._version = [0] * n_decode
        self._dirty: set[int] = set()
        n = len(self.arrival)
        nan = np.full(n, np.nan)
        self.r_prefill = np.full(n, -1, dtype=np.int64)
        self.r_decode = np.full(n, -1, dtype=np.int64)
        self.t_pstart, self.t_pend, self.t_dstart = nan.copy(), nan.copy(), nan.copy()
        self.t_first, self.t_finish = nan.copy(), nan.copy()
        self.ok = np.zeros(n, dtype=bool)
        self.events = 0
        # Python lists: scalar access in the event loop is several times cheaper than NumPy's.
        self._arr_l: list[float] = self.arrival.tolist()
        self._prompt_l: list[int] = self.prompt.tolist()
        self._out_l: list[int] = self.out.tolist()

    # --- heap ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a, b))

    def _reschedule(self, k: int) -> None:
        self._version[k] += 1
        t = self.decoders[k].next_event_time()
        if t != float("inf"):
            self._push(t, _DECODE, k, self._version[k])

    # --- handlers -----------------------------------------------------------------------------
    def _arrive(self, i: int, now: float) -> None:
        d = self.dispatcher
        if self._dirty and d.needs_progress:
            self._sync_progress(now)
        req = Request(i, self._arr_l[i], self._prompt_l[i], self._out_l[i])
        try:
            a = d.route(req, now)
        except NoCapacityError:
            return
        p = self._pre_index[d.index_of(a.prefill)]
        self.r_prefill[i] = p
        if a.decode is not None:
            self.r_decode[i] = self._dec_index[d.index_of(a.decode)]
        self.queues[p].append(i)
        if not self.busy[p]:
            self._start_prefill(p, now)

    def _start_prefill(self, p: int, now: float) -> None:
        i = self.queues[p].popleft()
        self.busy[p] = True
        self.t_pstart[i] = now
        self.dispatcher.on_prefill_start(i, now)
        self._push(now + self.profile.prefill_time(self._prompt_l[i]), _PREFILL_DONE, p, i)

    def _prefill_done(self, p: int, i: int, now: float) -> None:
        self.t_pend[i] = now
        self.dispatcher.on_prefill_end(i, now, now - self.t_pstart[i])
        self._push(now + self.profile.kv_transfer_time(self._prompt_l[i]), _DECODE_START, i)
        self.busy[p] = False
        if self.queues[p]:
            self._start_prefill(p, now)

    def _decode_start(self, i: int, now: float) -> None:
        k = int(self.r_decode[i])
        self.t_dstart[i] = now
        self.dispatcher.on_decode_start(i, now)
        self.decoders[k].admit(i, self._out_l[i], self._prompt_l[i], now)
        self._dirty.add(k)
        self._reschedule(k)

    def _decode_event(self, k: int, now: float) -> None:
        firsts, done = self.decoders[k].fire(now)
        for r, t in firsts:
            self.t_first[r] = t
        d = self.dispatcher
        for r in done:
            self.t_finish[r] = now
            self.ok[r] = True
            d.on_finish(r, now, self._out_l[r])
        rejected = getattr(self.decoders[k], "rejected", None)
        if rejected:
            for r in rejected:
                d.on_fail(r, now)
            rejected.clear()
        self._dirty.add(k)
        self._reschedule(k)

    def _sync_progress(self, now: float) -> None:
        d = self.dispatcher
        for k in self._dirty:
            reqs, gen = self.decoders[k].progress(now)
            if reqs:
                d.on_progress_bulk(reqs, np.asarray(gen), now)
        self._dirty.clear()

    # --- main loop ----------------------------------------------------------------------------
    def run(
        self, on_progress: Callable[[int, int], None] | None = None, every: int = 2000
    ) -> SimResult:
        n = len(self.arrival)
        heap = self._heap
        swaps = deque(self.swaps)
        for s in swaps:
            self._push(s.time, _SWAP, 0)
        next_i = 0
        finished_seen = 0
        arrivals = self._arr_l
        inf = float("inf")
        while next_i < n or heap:
            t_arr = arrivals[next_i] if next_i < n else inf
            if heap and heap[0][0] <= t_arr:
                t, kind, _, a, b = heapq.heappop(heap)
                if kind == _DECODE:
                    if b != self._version[a]:
                        continue
                    self._decode_event(a, t)
                elif kind == _PREFILL_DONE:
                    self._prefill_done(a, b, t)
                elif kind == _DECODE_START:
                    self._decode_start(a, t)
                else:
                    s = swaps.popleft()
                    self.dispatcher.set_policy(s.kind, s.name, s.params, source="sim", now=t)
            else:
                self._arrive(next_i, t_arr)
                next_i += 1
            self.events += 1
            if on_progress is not None and self.events % every == 0:
                done_now = next_i
                if done_now != finished_seen:
                    finished_seen = done_now
                    on_progress(done_now, n)
        if on_progress is not None:
            on_progress(n, n)
        ratios = self.dispatcher.assignment_ratios()
        return SimResult(
            arrival=self.arrival,
            prompt_tokens=self.prompt,
            output_tokens=self.out,
            prefill_instance=self.r_prefill,
            decode_instance=self.r_decode,
            prefill_start=self.t_pstart,
            prefill_end=self.t_pend,
            decode_start=self.t_dstart,
            first_token=self.t_first,
            finish=self.t_finish,
            ok=self.ok,
            instance_ids=self.prefill_ids + self.decode_ids,
            events=self.events,
            preemptions=sum(getattr(x, "preemptions", 0) for x in self.decoders),
            assignment_ratio=ratios.pop("active"),
            shadow_ratios=ratios,
            policy_events=list(self.dispatcher.policy_events),
        )
