"""Iteration-level continuous-batching decode instance: step time from batch size and resident KV.

Within an interval with a fixed batch of B sequences holding K₀ KV tokens, step i takes
step_time(B, K₀ + i·B), so n steps take a closed-form time and the next event (a finish, a KV
overflow that forces a preemption, or a step boundary where waiting requests join) is one jump.
Preemption is by recompute, as in vLLM: the latest-admitted request is evicted to the front of
the waiting queue and, when readmitted, its step pays prefill_time(prompt + generated).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from core.perf import PerfProfile

_EPS = 1e-9


@dataclass
class _Seq:
    out: int
    prompt: int
    generated: int = 0
    """Tokens generated at the start of the current interval (or when it was preempted)."""
    admit_seq: int = 0
    recompute: bool = False


class IterationDecodeInstance:
    """Decode instance with continuous batching, max_num_seqs, KV capacity and preemption."""

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile
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

    # --- timing of the current interval -----------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.running)

    def _t(self, n: int) -> float:
        """Time from the interval start until n steps are done."""
        if n <= 0:
            return 0.0
        return self.extra + self.profile.steps_time(n, self.batch, self.kv0)

    def _steps_done(self, now: float) -> int:
        if not self.running:
            return 0
        return self.profile.steps_within(now - self.t0 - self.extra + _EPS, self.batch, self.kv0)

    # --- events ------------------------------------------------------------------------------
    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None:
        """A request arrives for decoding; it joins the batch at the next step boundary."""
        self.seqs[req] = _Seq(out=output_tokens, prompt=prompt_tokens)
        self.waiting.append(req)
        if not self.running:
            self.rebase_at = now
            return
        done = self._steps_done(now)
        at_boundary = abs(self.t0 + self._t(done) - now) <= _EPS
        self.rebase_at = min(self.rebase_at, now if at_boundary else self.t0 + self._t(done + 1))

    def next_event_time(self) -> float:
        nxt = self.rebase_at
        if self.running:
            remaining = min(self.seqs[r].out - self.seqs[r].generated for r in self.running)
            nxt = min(nxt, self.t0 + self._t(remaining))
            room = (self.capacity - self.kv0) // self.batch
            if room < remaining:
                nxt = min(nxt, self.t0 + self._t(max(room, 0)))
        return nxt

    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]:
        """Process the boundary at `now`: finishes, preemptions, admissions; start a new interval."""
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
            if finished:
                gone = set(finished)
                self.running = [r for r in self.running if r not in gone]
        kv = sum(self.seqs[r].prompt + self.seqs[r].generated for r in self.running)
        # Preempt (latest admitted first) until the next step fits in the KV cache.
        while self.running and kv + len(self.running) > self.capacity:
            victim = max(self.running, key=lambda r: self.seqs[r].admit_seq)
            self.running.remove(victim)
            s = self.seqs[victim]
            kv -= s.prompt + s.generated
            s.recompute = True
            self.waiting.appendleft(victim)
            self.preemptions += 1
        extra = 0.0
        while self.waiting and len(self.running) < self.max_seqs:
            s = self.seqs[self.waiting[0]]
            need = s.prompt + s.generated + 1
            if kv + len(self.running) + need > self.capacity:
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
        self.t0, self.extra, self.kv0 = now, extra, kv
        self.rebase_at = float("inf")
        return firsts, done

    def remove(self, req: int, now: float) -> None:
        """Drop a request (failure or migration) at the next boundary's accounting."""
        self.fire(now) if self.running else None
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.seqs.pop(req, None)
        self.kv0 = sum(self.seqs[r].prompt + self.seqs[r].generated for r in self.running)

    def progress(self, now: float) -> tuple[list[int], list[float]]:
        n = self._steps_done(now)
        reqs = list(self.running) + list(self.waiting)
        gen = [
            float(self.seqs[r].generated + (n if i < len(self.running) else 0))
            for i, r in enumerate(reqs)
        ]
        return reqs, gen
