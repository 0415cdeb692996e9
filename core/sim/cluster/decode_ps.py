"""Processor-sharing decode instance (SIBYL App. I): every running request decodes at TPS(N)/N.

One counter per instance gives every request's progress: C(t) advances at the per-request rate,
a request that joined when the counter read c has generated C(t) − c tokens. Its first token is
due at C = c + 1 and its last at C = c + out, so the next event is a closed-form jump.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

import numpy as np

from core.perf import PerfProfile
from core.sim.cluster.decode_iter import Detached

_EPS = 1e-9


class PSDecodeInstance:
    """Decode instance under processor sharing; exact, no per-token ticks."""

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile
        self.counter = 0.0
        self.t_last = 0.0
        self.rate = 0.0
        self.offset: dict[int, float] = {}
        """Running request index → counter value when it joined."""
        self._first: list[tuple[float, int]] = []
        self._finish: list[tuple[float, int]] = []
        self.lora_step: Callable[[Iterable[int]], float] | None = None
        """Seconds the running requests' distinct LoRA adapters add to a step (None: no LoRA)."""

    @property
    def running(self) -> int:
        return len(self.offset)

    def token_rate(self) -> float:
        """Tokens per second the running requests receive together now."""
        return self.rate * len(self.offset)

    def _advance(self, now: float) -> None:
        if now < self.t_last:  # stalled (an adapter load) until t_last
            return
        self.counter += self.rate * (now - self.t_last)
        self.t_last = now

    def _rerate(self) -> None:
        self.rate = self.profile.per_request_rate(len(self.offset))
        if self.lora_step is not None and self.rate > 0:  # a step of N takes N/TPS(N), plus the adapters' cost
            self.rate = 1.0 / (1.0 / self.rate + self.lora_step(self.offset))

    def stall(self, now: float, seconds: float) -> None:
        """Nothing decodes for `seconds` from now (an adapter load, as the emulator's engine stalls)."""
        self._advance(now)
        self.t_last = max(self.t_last, now + seconds)

    def admit(self, req: int, output_tokens: int, now: float) -> None:
        self._advance(now)
        c = self.counter
        self.offset[req] = c
        heapq.heappush(self._first, (c + 1, req))
        heapq.heappush(self._finish, (c + output_tokens, req))
        self._rerate()

    def remove(self, req: int, now: float) -> None:
        """Take a request off the instance (migration or failure); its heap entries go stale."""
        self._advance(now)
        self.offset.pop(req, None)
        self._rerate()

    def next_event_time(self) -> float:
        self._drop_stale()
        first, finish = self._first, self._finish
        if self.rate <= 0 or not (first or finish):
            return float("inf")
        if first and finish:
            key = first[0][0] if first[0][0] < finish[0][0] else finish[0][0]
        else:
            key = (first or finish)[0][0]
        gap = key - self.counter
        return self.t_last + (gap if gap > 0.0 else 0.0) / self.rate

    def _drop_stale(self) -> None:
        for h in (self._first, self._finish):
            while h and h[0][1] not in self.offset:
                heapq.heappop(h)

    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]:
        """Advance to `now`; return ((request, first-token time) pairs due, finished requests)."""
        self._advance(now)
        limit = self.counter + _EPS * max(1.0, self.counter)
        firsts: list[tuple[int, float]] = []
        while self._first and self._first[0][0] <= limit:
            _, r = heapq.heappop(self._first)
            if r in self.offset:
                firsts.append((r, now))
        done: list[int] = []
        while self._finish and self._finish[0][0] <= limit:
            _, r = heapq.heappop(self._finish)
            if r in self.offset:
                done.append(r)
                del self.offset[r]
        if done:
            self._rerate()
        return firsts, done

    def progress(self, now: float) -> tuple[list[int], np.ndarray]:
        """Running requests and their generated tokens at `now` (the counter less each one's offset)."""
        c = self.counter + self.rate * max(now - self.t_last, 0.0)
        offsets = self.offset
        return list(offsets), c - np.fromiter(offsets.values(), dtype=np.float64, count=len(offsets))


class PSDecodeModel(PSDecodeInstance):
    """Processor sharing with the cluster engine's admit signature (core.sim.cluster.decode.DecodeModel) and
    migration support.

    Processor sharing has no step boundaries and no KV capacity, so a migrating request pauses at
    once and a target always has room (reservations are no-ops).
    """

    def __init__(self, profile: PerfProfile) -> None:
        super().__init__(profile)
        self.detached: list[Detached] = []
        self._sizes: dict[int, tuple[int, int]] = {}
        """Request → (prompt tokens, output tokens), for the requests that may migrate."""

    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None:  # type: ignore[override]
        self._sizes[req] = (prompt_tokens, output_tokens)
        super().admit(req, output_tokens, now)

    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]:
        firsts, done = super().fire(now)
        for r in done:
            self._sizes.pop(r, None)
        return firsts, done

    def read_done(self, start: float, seconds: float) -> float:
        """SIBYL App. I's flat transfer: reads overlap (core/sim/cluster/decode.py)."""
        return start + seconds

    def next_step_boundary(self, now: float) -> float:
        """`now`: processor sharing has no steps, so a P/D hand-off's KV read starts at once and the
        request joins when it ends (SIBYL's flat transfer, App. I)."""
        return now

    def is_running(self, req: int) -> bool:
        return req in self.offset

    def tokens_of(self, req: int, now: float) -> int:
        _, gen = self._generated(req, now)
        return self._sizes[req][0] + int(gen)

    def _generated(self, req: int, now: float) -> tuple[float, float]:
        c = self.counter + self.rate * max(now - self.t_last, 0.0)
        return c, c - self.offset[req]

    def can_host(self, tokens: int, now: float) -> bool:
        return True

    def reserve(self, req: int, tokens: int, now: float) -> None:
        return None

    def unreserve(self, req: int, now: float) -> None:
        return None

    def release_outgoing(self, req: int, now: float) -> None:
        return None

    def request_detach(self, req: int, now: float) -> bool:
        if req not in self.offset:
            return False
        _, gen = self._generated(req, now)
        prompt, out = self._sizes.pop(req)
        self.remove(req, now)
        self.detached.append((req, prompt, gen, out))
        return True

    def attach(self, req: int, prompt: int, generated: float, out: int, now: float) -> None:
        """Resume with `generated` tokens done: the counter offset is set back by that much."""
        self._advance(now)
        # Entries left by an earlier stay of this request here would look live again: drop them.
        for h in (self._first, self._finish):
            if any(r == req for _, r in h):
                h[:] = [e for e in h if e[1] != req]
                heapq.heapify(h)
        off = self.counter - generated
        self.offset[req] = off
        self._sizes[req] = (prompt, out)
        if generated < 1.0:
            heapq.heappush(self._first, (off + 1, req))
        heapq.heappush(self._finish, (off + out, req))
        self._rerate()
