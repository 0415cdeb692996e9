"""Iteration-level continuous-batching decode instance: step time from batch size and resident KV.

Within an interval with a fixed batch of B sequences holding K₀ KV tokens, step i takes
step_time(B, K₀ + i·B), so n steps take a closed-form time and the next event (a finish, a KV
overflow that forces a preemption, or a step boundary where waiting requests join) is one jump.
The first step after the batch was empty for g seconds costs the profile's `wake_time(g)` more
(the emulator's engine pays it too). Preemption is by recompute, as in vLLM: the latest-admitted
request is evicted to the front of the waiting queue and, when readmitted, its step pays
prefill_time(prompt + generated).

Decode-to-decode migration (core/sim/cluster/migration.py drives it) uses KV held *outside* the batch:
`reserved` tokens count against the KV capacity but are not read by a step, so they cost memory
and no step time. A target reserves the migrating request's tokens before the transfer
(`reserve`); the source pauses the request at its next step boundary (`request_detach`) and keeps
its KV until the transfer ends (`release_outgoing`); the target then holds the request in its
waiting queue with its KV already resident (`attach`) and lets it join at its next boundary
before any other waiting request, without a recompute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from core.perf import PerfProfile
from core.sim.cluster.lora import steps_time_plus, steps_within_plus

_EPS = 1e-9

Detached = tuple[int, int, float, int]
"""(request, prompt tokens, generated tokens, output tokens) of a request paused for migration."""


@dataclass
class _Seq:
    out: int
    prompt: int
    generated: int = 0
    """Tokens generated at the start of the current interval (or when it was preempted)."""
    admit_seq: int = 0
    recompute: bool = False
    held: bool = False
    """Its KV is resident here and counted in `reserved` (a migrated request not yet in the batch)."""


class IterationDecodeInstance:
    """Decode instance with continuous batching, max_num_seqs, KV capacity and preemption."""

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile
        self._reads_free = -float("inf")
        """When the last hand-off KV read here ends (reads go one at a time)."""
        self.capacity = profile.kv_capacity_tokens
        self.max_seqs = profile.max_num_seqs
        self.seqs: dict[int, _Seq] = {}
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self.t0 = 0.0
        self.extra = 0.0
        self.kv0 = 0
        self.rebase_at = float("inf")
        self.preemptions = 0
        self.rejected: list[int] = []
        """Requests that can never fit in this instance's KV cache."""
        self._admits = 0
        # --- migration state ---
        self.reserved = 0
        """KV tokens resident outside the running batch: incoming reservations, migrated requests
        waiting to join, and outgoing requests whose transfer is under way."""
        self.incoming: dict[int, int] = {}
        """Request → tokens reserved for it before its KV arrives."""
        self.outgoing: dict[int, int] = {}
        """Request → tokens it still holds here while its KV is transferred away."""
        self.detach_pending: set[int] = set()
        """Running requests to pause at the next step boundary."""
        self.detached: list[Detached] = []
        """Requests paused for migration since the caller last drained this list."""
        self._held_waiting = 0
        self._floor = 0.0
        """The latest time the caller told us about; no event is ever scheduled before it."""
        # --- LoRA (core/sim/cluster/lora.py) ---
        self.lora_step: Callable[[Iterable[int]], float] | None = None
        """Seconds a step of these requests' distinct adapters adds (None: no LoRA)."""
        self.step_extra_s = 0.0
        """What the current interval's batch adds to each step (its adapters)."""
        self.stall_until = 0.0
        """No step starts before this (an adapter load)."""
        self.idle_from = -float("inf")
        """When the batch last emptied (the first step after idling pays `profile.wake_time`)."""

    # --- timing of the current interval -----------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.running)

    def token_rate(self) -> float:
        """Tokens per second the batch emits now: one per running request a step."""
        if not self.running:
            return 0.0
        return self.batch / (self.profile.step_time(self.batch, self.kv0) + self.step_extra_s)

    def _t(self, n: int) -> float:
        """Time from the interval start until n steps are done."""
        if n <= 0:
            return 0.0
        if self.step_extra_s:
            return self.extra + steps_time_plus(self.profile, n, self.batch, self.kv0, self.step_extra_s)
        return self.extra + self.profile.steps_time(n, self.batch, self.kv0)

    def _steps_done(self, now: float) -> int:
        if not self.running:
            return 0
        dt = now - self.t0 - self.extra + _EPS
        if self.step_extra_s:
            return steps_within_plus(self.profile, dt, self.batch, self.kv0, self.step_extra_s)
        return self.profile.steps_within(dt, self.batch, self.kv0)

    def _next_boundary(self, now: float) -> float:
        """`now` if a step ends (or nothing runs) at `now`, else the end of the step under way."""
        if not self.running:
            return now
        done = self._steps_done(now)
        if abs(self.t0 + self._t(done) - now) <= _EPS:
            return now
        return self.t0 + self._t(done + 1)

    def read_done(self, start: float, seconds: float) -> float:
        """After the reads under way here: one KV read at a time (core/sim/cluster/decode.py)."""
        self._reads_free = max(start, self._reads_free) + seconds
        return self._reads_free

    def next_step_boundary(self, now: float) -> float:
        """When the step under way ends (`now` when a step ends at `now` or nothing runs): where a P/D
        hand-off's KV read starts, as vLLM's worker issues it in the step after its scheduler admitted
        the request (core/sim/cluster/engine.py)."""
        return self._next_boundary(now)

    def _rebase_soon(self, now: float) -> None:
        """Process a boundary at the next step end (or at once when idle)."""
        self._floor = max(self._floor, now)
        self.rebase_at = min(self.rebase_at, self._next_boundary(now))

    def resident_tokens(self, now: float) -> int:
        """KV tokens held at `now`: the batch's (as of its last whole step) plus `reserved`."""
        return self.kv0 + self.batch * self._steps_done(now) + self.reserved

    # --- events ------------------------------------------------------------------------------
    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None:
        """A request arrives for decoding; it joins the batch at the next step boundary."""
        self.seqs[req] = _Seq(out=output_tokens, prompt=prompt_tokens)
        self.waiting.append(req)
        self._rebase_soon(now)

    def next_event_time(self) -> float:
        nxt = self.rebase_at
        if self.running:
            remaining = min(self.seqs[r].out - self.seqs[r].generated for r in self.running)
            nxt = min(nxt, self.t0 + self._t(remaining))
            room = (self.capacity - self.reserved - self.kv0) // self.batch
            if room < remaining:
                t_over = self.t0 + self._t(max(room, 0))
                if t_over < self._floor - _EPS:
                    # A reservation made the overflow past already: preempt at the next boundary.
                    t_over = self._next_boundary(self._floor)
                nxt = min(nxt, t_over)
        return nxt

    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]:
        """Process the boundary at `now`: finishes, preemptions, admissions; start a new interval."""
        self._floor = max(self._floor, now)
        firsts: list[tuple[int, float]] = []
        done: list[int] = []
        n = self._steps_done(now)
        if n > 0:
            first_at = self.t0 + self._t(1)
            for r in self.running:
                s = self.seqs[r]
                if s.generated == 0:
                    firsts.append((r, first_at))
                s.generated += n
            finished = [r for r in self.running if self.seqs[r].generated >= self.seqs[r].out]
            for r in finished:
                done.append(r)
                del self.seqs[r]
                self.detach_pending.discard(r)
            if finished:
                gone = set(finished)
                self.running = [r for r in self.running if r not in gone]
        if self.detach_pending:
            self._detach_now()
        kv = sum(self.seqs[r].prompt + self.seqs[r].generated for r in self.running)
        # Preempt (latest admitted first) until the next step fits in the KV cache.
        while self.running and kv + self.reserved + len(self.running) > self.capacity:
            victim = max(self.running, key=lambda r: self.seqs[r].admit_seq)
            self.running.remove(victim)
            s = self.seqs[victim]
            kv -= s.prompt + s.generated
            s.recompute = True
            self.waiting.appendleft(victim)
            self.preemptions += 1
        was_idle = not self.running
        if was_idle and n > 0:
            self.idle_from = now  # the batch emptied at this boundary
        if self._held_waiting:
            kv = self._admit_held(kv)
        extra = self.stall_until - now if self.stall_until > now else 0.0
        while self.waiting and len(self.running) < self.max_seqs:
            s = self.seqs[self.waiting[0]]
            need = s.prompt + s.generated + 1
            if kv + self.reserved + len(self.running) + need > self.capacity:
                if not self.running and need > self.capacity:
                    self.rejected.append(self.waiting.popleft())
                    continue
                break
            r = self.waiting.popleft()
            self.running.append(r)
            kv += s.prompt + s.generated
            self._admits += 1
            s.admit_seq = self._admits
            if s.recompute:
                extra += float(self.profile.prefill_time(s.prompt + s.generated))
                s.recompute = False
        if was_idle and self.running:
            extra += self.profile.wake_time(now - self.idle_from)
        self.t0, self.extra, self.kv0 = now, extra, kv
        if self.lora_step is not None:
            self.step_extra_s = self.lora_step(self.running)
        self.rebase_at = float("inf")
        return firsts, done

    def stall(self, now: float, seconds: float) -> None:
        """Hold the next step back until `seconds` from now (an adapter load, as the emulator's engine stalls)."""
        self.stall_until = max(self.stall_until, now + seconds)
        self._rebase_soon(now)

    def _detach_now(self) -> None:
        """Pause the requests waiting to migrate; their KV stays here (outgoing) until released."""
        for r in sorted(self.detach_pending):
            if r not in self.running:
                continue
            s = self.seqs.pop(r)
            self.running.remove(r)
            tokens = s.prompt + s.generated
            self.outgoing[r] = tokens
            self.reserved += tokens
            self.detached.append((r, s.prompt, float(s.generated), s.out))
        self.detach_pending.clear()

    def _admit_held(self, kv: int) -> int:
        """Migrated requests (KV already resident) join first, while the batch has room."""
        for r in [r for r in self.waiting if self.seqs[r].held]:
            if len(self.running) >= self.max_seqs:
                break
            s = self.seqs[r]
            if kv + self.reserved + len(self.running) + 1 > self.capacity:
                break
            tokens = s.prompt + s.generated
            self.waiting.remove(r)
            self.running.append(r)
            s.held = False
            self._held_waiting -= 1
            self.reserved -= tokens
            kv += tokens
            self._admits += 1
            s.admit_seq = self._admits
        return kv

    def remove(self, req: int, now: float) -> None:
        """Drop a request (failure or migration) at the next boundary's accounting."""
        self.fire(now) if self.running else None
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.seqs.pop(req, None)
        self.kv0 = sum(self.seqs[r].prompt + self.seqs[r].generated for r in self.running)

    def progress(self, now: float) -> tuple[list[int], np.ndarray]:
        n = self._steps_done(now)
        reqs = list(self.running) + list(self.waiting)
        gen = [float(self.seqs[r].generated + (n if i < len(self.running) else 0)) for i, r in enumerate(reqs)]
        return reqs, np.asarray(gen)

    # --- migration -----------------------------------------------------------------------------
    def is_running(self, req: int) -> bool:
        """Whether `req` is in the running batch (and not already leaving it)."""
        return req in self.seqs and req in self.running and req not in self.detach_pending

    def tokens_of(self, req: int, now: float) -> int:
        """KV tokens (prompt + generated) of a request here at `now`."""
        s = self.seqs[req]
        ran = self._steps_done(now) if req in self.running else 0
        return s.prompt + s.generated + min(ran, s.out - s.generated)

    def can_host(self, tokens: int, now: float) -> bool:
        """Whether `tokens` more KV tokens fit now, with room for the batch's next step and its own."""
        free = self.capacity - self.resident_tokens(now)
        return free >= tokens + self.batch + 1

    def reserve(self, req: int, tokens: int, now: float) -> None:
        """Hold `tokens` of KV for an incoming migration (before its transfer starts)."""
        self.incoming[req] = self.incoming.get(req, 0) + tokens
        self.reserved += tokens
        self._floor = max(self._floor, now)

    def unreserve(self, req: int, now: float) -> None:
        """Drop an incoming reservation (the migration was cancelled)."""
        self.reserved -= self.incoming.pop(req, 0)
        self._floor = max(self._floor, now)
        if self.waiting:
            self._rebase_soon(now)

    def request_detach(self, req: int, now: float) -> bool:
        """Pause a running request at the next step boundary (False if it is not running)."""
        if not self.is_running(req):
            return False
        self.detach_pending.add(req)
        self._rebase_soon(now)
        return True

    def release_outgoing(self, req: int, now: float) -> None:
        """The transfer of a paused request ended: free its KV here."""
        self.reserved -= self.outgoing.pop(req, 0)
        self._floor = max(self._floor, now)
        if self.waiting:
            self._rebase_soon(now)

    def attach(self, req: int, prompt: int, generated: float, out: int, now: float) -> None:
        """A migrated request's KV has arrived: it joins at the next boundary, without recompute.

        Its reservation becomes the exact size of its KV (it may have grown by a step since).
        """
        g = int(generated)
        tokens = prompt + g
        self.reserved += tokens - self.incoming.pop(req, 0)
        self.seqs[req] = _Seq(out=out, prompt=prompt, generated=g, held=True)
        self.waiting.appendleft(req)
        self._held_waiting += 1
        self._rebase_soon(now)
