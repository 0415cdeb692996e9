"""Iteration-level simulator of ONE vLLM-like instance serving whole requests (prefill + decode).

Model (vLLM v1 semantics, vllm/v1/core/sched/scheduler.py, unless an ordering says otherwise):

* Every request has ``num_tokens = prompt + generated`` and ``computed`` tokens whose KV exists.
  A step gives it ``q = num_tokens − computed`` new tokens, capped at ``chunk_size`` (vLLM's
  ``long_prefill_token_threshold``) and at what is left of the step's ``token_budget``
  (``max_num_batched_tokens``). When a step computes all of ``num_tokens`` a token is sampled:
  the last prefill chunk yields the first token (TTFT), every decode step one more.
* KV lives in blocks of ``block_size`` tokens; a request holds ``ceil(computed / block)`` blocks and
  a step needs blocks for ``computed + q``. A waiting request is admitted only if blocks for its
  whole input ``num_tokens`` are free (vLLM 0.32 ``scheduler_reserve_full_isl``, on by default),
  though only the chunk's blocks are allocated. At most ``max_num_seqs`` requests are resident
  (RUNNING, holding KV). A resident request that is not in a step's batch keeps its KV and pauses.
* When a request cannot get its blocks (or a waiting one a seat), the ordering names a victim,
  which is preempted by recompute: its blocks are freed, ``computed = 0``, it goes back to the
  waiting queue and later re-prefills prompt + generated tokens (vLLM v1 only recomputes).
* The scan order of a step is the ordering's key over running and waiting requests (lowest
  first). A waiting request never overtakes a higher-priority waiting request that could not be
  admitted (strict admission order); resident requests further down still run if they fit.
  If a step would otherwise be empty, the ordering's forced victim (vLLM's rule: the
  lowest-priority resident request, possibly the requester itself) breaks the deadlock.
* Step time from the PerfProfile: decode entries cost ``step_time(#decodes, Σ their context)``
  (``decode_step_base_s`` + per sequence + per resident KV token read); each prefill chunk of
  ``c`` tokens at context offset ``o`` adds ``prefill_per_token_s·c +
  prefill_per_token2_s·((o+c)² − o²)`` (the causal-attention area of the chunk). A step with no
  decode pays ``prefill_base_s`` as its fixed cost instead, so a lone whole-prompt prefill costs
  exactly ``prefill_time(prompt)``.

Step-driven and deterministic: same inputs, same result. Arrivals during a step join at the next
step boundary.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from core.perf import PerfProfile
from core.sim.instance.model import (
    DONE,
    REJECTED,
    RUNNING,
    WAITING,
    InstanceParams,
    InstanceSimResult,
    Key,
    Ordering,
    SimRequest,
    SimStep,
)


class InstanceSim:
    """One instance: submit requests (any order of arrival times), then `run()` or `step()`."""

    def __init__(self, profile: PerfProfile, ordering: Ordering, params: InstanceParams | None = None) -> None:
        p = params or InstanceParams()
        self.profile = profile
        self.params = p
        self.ordering = ordering
        self.block_size = p.block_size or profile.block_size
        cap = p.kv_capacity_tokens or profile.kv_capacity_tokens
        self.total_blocks = cap // self.block_size
        self.free_blocks = self.total_blocks
        self.max_seqs = p.max_num_seqs or profile.max_num_seqs
        self.token_budget = p.token_budget
        self.chunk_size = p.chunk_size
        self.reserve_full_isl = p.reserve_full_isl
        self.now = 0.0
        self.step_no = 0
        self.running: list[SimRequest] = []
        """Resident requests in admission order (vLLM's running list)."""
        self.waiting: dict[int, SimRequest] = {}
        self._heap: list[tuple[Key, int, int, SimRequest]] = []
        self.requests: list[SimRequest] = []
        self._pending: list[tuple[float, int, SimRequest]] = []
        """Submitted requests not yet arrived: heap of (arrival, rid)."""
        self._admits = 0
        self._queue_seq = 0
        self.forced_evictions = 0
        self.evictions_for_waiting = 0
        """Preemptions made to admit a waiting request (KV or a seat)."""
        self.evictions_for_running = 0
        """Preemptions made because a resident request needed KV blocks."""
        self.rejected = 0
        self.busy_s = 0.0
        ordering.bind(self)

    # --- requests ----------------------------------------------------------------------------
    def submit(self, rid: int, arrival: float, prompt: int, output: int) -> SimRequest:
        """Register a request that arrives at `arrival` (it joins at the first step boundary
        at or after its arrival)."""
        if prompt < 1 or output < 1:
            raise ValueError(f"request {rid}: prompt and output must be >= 1")
        r = SimRequest(rid=rid, arrival=float(arrival), prompt=int(prompt), output=int(output))
        self.requests.append(r)
        if self._blocks_for(r.prompt + r.output) > self.total_blocks:
            r.state = REJECTED  # could never fit in the KV cache, even alone
            self.rejected += 1
            return r
        heapq.heappush(self._pending, (r.arrival, rid, r))
        return r

    def _arrive(self, now: float) -> None:
        pend = self._pending
        while pend and pend[0][0] <= now:
            r = heapq.heappop(pend)[2]
            self._queue_seq += 1
            r.queue_seq = self._queue_seq
            r.idle_base = self.step_no
            self.ordering.on_arrival(r, now)
            self._push_waiting(r)

    def _push_waiting(self, r: SimRequest) -> None:
        r.state = WAITING
        r.ver += 1
        self.waiting[r.rid] = r
        heapq.heappush(self._heap, (self.ordering.key(r), r.ver, r.rid, r))

    def requeue(self, r: SimRequest) -> None:
        """Re-key one waiting request (after its ordering changed its key)."""
        if r.state == WAITING and r.rid in self.waiting:
            r.ver += 1
            heapq.heappush(self._heap, (self.ordering.key(r), r.ver, r.rid, r))

    def rekey_waiting(self) -> None:
        """Rebuild the waiting heap from scratch (after a global key change, e.g. a new γ)."""
        key = self.ordering.key
        self._heap = [(key(r), r.ver, r.rid, r) for r in self.waiting.values()]
        heapq.heapify(self._heap)

    def waiting_in_order(self) -> list[SimRequest]:
        """Waiting requests in their current scan order (for tests and inspection)."""
        return sorted(self.waiting.values(), key=lambda r: (self.ordering.key(r), r.rid))

    def _pop_waiting(self) -> tuple[Key, SimRequest] | None:
        heap = self._heap
        while heap:
            k, ver, _, r = heap[0]
            if r.state == WAITING and ver == r.ver:
                heapq.heappop(heap)
                return k, r
            heapq.heappop(heap)
        return None

    def _peek_waiting_key(self) -> Key | None:
        heap = self._heap
        while heap:
            k, ver, _, r = heap[0]
            if r.state == WAITING and ver == r.ver:
                return k
            heapq.heappop(heap)
        return None

    # --- KV ------------------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def evict(self, v: SimRequest) -> None:
        """Preempt a running request by recompute: free its KV, back to the waiting queue."""
        self.running.remove(v)
        self.free_blocks += v.blocks
        v.blocks = 0
        v.computed = 0
        v.preemptions += 1
        v.evicted_step = self.step_no
        v.idle_base = self.step_no
        self._queue_seq += 1
        v.queue_seq = -self._queue_seq  # vLLM FCFS prepends preempted requests
        self.ordering.on_evict(v)
        self._push_waiting(v)

    # --- one step ------------------------------------------------------------------------------
    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], list[int]]:
        o = self.ordering
        o.before_step(self.now)
        key = o.key
        run = sorted(((key(r), r.admit_seq, r) for r in self.running), key=lambda e: e[:2])
        budget = self.token_budget
        batch: dict[int, tuple[SimRequest, int]] = {}
        preempted: list[int] = []
        put_back: list[SimRequest] = []
        admit_open = True
        step = self.step_no
        i, n_run = 0, len(run)
        while budget > 0:
            wk = self._peek_waiting_key() if admit_open else None
            if i < n_run and (wk is None or run[i][0] <= wk):
                r = run[i][2]
                i += 1
                if r.state != RUNNING:
                    continue  # preempted earlier in this step
            elif wk is not None:
                got = self._pop_waiting()
                assert got is not None
                r = got[1]
                if r.evicted_step == step:
                    put_back.append(r)  # just preempted for someone ahead: not back this step
                    continue
                if preempted and not o.admit_after_preemption:
                    put_back.append(r)
                    admit_open = False
                    continue
            else:
                break
            waiting = r.state == WAITING
            q = r.prompt + r.generated - r.computed
            if q > 1:
                q = min(q, self.chunk_size, budget)
            need = self._blocks_for(r.computed + q) - r.blocks
            check = need
            if waiting and self.reserve_full_isl:
                check = self._blocks_for(r.prompt + r.generated) - r.blocks
            ok = True
            while check > self.free_blocks or (waiting and len(self.running) >= self.max_seqs):
                v = o.victim(r, False)
                if v is None and not waiting and not batch:
                    v = o.victim(r, True)
                    if v is not None:
                        self.forced_evictions += 1
                if v is None:
                    ok = False
                    break
                if v.state != RUNNING:
                    raise RuntimeError(f"{o.name}: victim {v.rid} is not running")
                got_v = batch.pop(v.rid, None)
                if got_v is not None:
                    budget += got_v[1]
                self.evict(v)
                preempted.append(v.rid)
                if waiting:
                    self.evictions_for_waiting += 1
                else:
                    self.evictions_for_running += 1
                if v is r:
                    ok = False
                    break
            if not ok:
                if waiting:
                    put_back.append(r)
                    admit_open = False
                continue
            if waiting:
                del self.waiting[r.rid]
                r.state = RUNNING
                self._admits += 1
                r.admit_seq = self._admits
                self.running.append(r)
            r.blocks += need
            self.free_blocks -= need
            budget -= q
            r.sched_step = step
            batch[r.rid] = (r, q)
            o.on_scheduled(r)
        for r in put_back:
            if r.state == WAITING:
                heapq.heappush(self._heap, (key(r), r.ver, r.rid, r))
        return list(batch.values()), preempted

    def _cost(self, batch: list[tuple[SimRequest, int]]) -> tuple[float, int, int]:
        prof = self.profile
        n_dec = 0
        kv = 0
        prefill_tokens = 0
        chunk = 0.0
        a1, a2 = prof.prefill_per_token_s, prof.prefill_per_token2_s
        for r, q in batch:
            if q == 1 and r.generated > 0 and r.computed == r.prompt + r.generated - 1:
                n_dec += 1
                kv += r.computed
            else:
                o = r.computed
                e = o + q
                chunk += a1 * q + a2 * (e * e - o * o)
                prefill_tokens += q
        base = prof.step_time(n_dec, kv) if n_dec else prof.prefill_base_s
        return base + chunk, n_dec, prefill_tokens

    def step(self) -> SimStep | None:
        """Admit arrivals up to now, schedule one step and execute it; None if idle."""
        self._arrive(self.now)
        if not self.running and not self.waiting:
            return None
        start = self.now
        batch, preempted = self._schedule()
        if not batch:
            if self.running:
                raise RuntimeError(f"{self.ordering.name}: no progress with requests resident")
            return None
        dt, n_dec, prefill_tokens = self._cost(batch)
        end = start + dt
        tokens = 0
        finished: list[SimRequest] = []
        for r, q in batch:
            tokens += q
            was = r.computed
            r.computed = was + q
            if was < r.hw:
                r.recomputed += min(r.computed, r.hw) - was
            if r.computed > r.hw:
                r.hw = r.computed
            if r.computed == r.prompt + r.generated:
                r.generated += 1
                if r.generated == 1:
                    r.first_token = end
                if r.generated >= r.output:
                    finished.append(r)
        self.step_no += 1
        self.now = end
        self.busy_s += dt
        self.ordering.after_step(dt, tokens, end)
        for r in finished:
            r.state = DONE
            r.finish = end
            self.running.remove(r)
            self.free_blocks += r.blocks
            r.blocks = 0
            self.ordering.on_finish(r, end)
        return SimStep(
            start=start,
            dt=dt,
            batch=[(r.rid, q) for r, q in batch],
            preempted=preempted,
            decodes=n_dec,
            prefill_tokens=prefill_tokens,
        )

    # --- whole runs ---------------------------------------------------------------------------
    def next_arrival(self) -> float:
        return self._pending[0][0] if self._pending else math.inf

    def run(self, progress: int = 0) -> InstanceSimResult:
        """Run until every submitted request has finished (or was rejected); with `progress`
        > 0, `on_progress` is called every that many steps."""
        while self._pending or self.running or self.waiting:
            rec = self.step()
            if rec is None:
                if self.waiting and not self.running:
                    # nothing resident and the head cannot be admitted into an empty cache
                    raise RuntimeError(f"{self.ordering.name}: waiting requests cannot start")
                nxt = self.next_arrival()
                if math.isinf(nxt):
                    break
                self.now = max(self.now, nxt)
            elif progress and self.step_no % progress == 0:
                self.on_progress()
        return self.result()

    def on_progress(self) -> None:
        """Hook called every `progress` steps by `run` (the benchmark prints from it)."""

    def result(self) -> InstanceSimResult:
        reqs = self.requests
        arr = np.array([r.arrival for r in reqs])
        fin = np.array([r.finish for r in reqs])
        first = np.array([r.first_token for r in reqs])
        trace = getattr(self.ordering, "trace", [])
        counters = getattr(self.ordering, "counters", None)
        return InstanceSimResult(
            ordering=self.ordering.name,
            arrival=arr,
            prompt=np.array([r.prompt for r in reqs], dtype=np.int64),
            output=np.array([r.output for r in reqs], dtype=np.int64),
            ttft=first - arr,
            e2e=fin - arr,
            preemptions=np.array([r.preemptions for r in reqs], dtype=np.int64),
            recomputed=np.array([r.recomputed for r in reqs], dtype=np.int64),
            rejected=self.rejected,
            steps=self.step_no,
            busy_s=self.busy_s,
            makespan_s=(float(np.nanmax(fin)) - float(arr.min())) if len(reqs) else 0.0,
            forced_evictions=self.forced_evictions,
            evictions_for_waiting=self.evictions_for_waiting,
            evictions_for_running=self.evictions_for_running,
            trace=list(trace),
            counters=dict(counters()) if callable(counters) else {},
        )


def simulate_instance(
    profile: PerfProfile,
    ordering: Ordering,
    arrivals: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    params: InstanceParams | None = None,
) -> InstanceSimResult:
    """Run one instance over a whole trace (request i gets id i)."""
    inst = InstanceSim(profile, ordering, params)
    for i, (a, p, o) in enumerate(zip(arrivals, prompt_tokens, output_tokens, strict=True)):
        inst.submit(i, float(a), int(p), int(o))
    return inst.run()
