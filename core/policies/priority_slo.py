"""HyperFlexis' dynamic SLO assignment (its §5.2, Algorithm 2): a request that carries only a
priority gets TTFT/TPOT targets from sliding windows of recently completed requests.

Spec: ../shared/design/papers/hyperflexis.md §3.8. Two windows of the last W completions — sorted
(TTFT, queue time) and sorted TPOT — and per-priority counts C_p of the entries in them. A new
request of priority p (0 highest of N levels) reads index idx = Σ_{i<p} C_i + ⌊(p+1)/(N+1)·C_p⌋
in both windows: higher priority, lower-latency quantile. Its TTFT is corrected by the queue-time
difference between that reference and the latest completed request of priority p (the prose
version, as the spec chooses), then both targets are clamped to priority p's range
[(1−r)·mid, (1+r)·mid]; while no higher-priority request is pending, the lower bound relaxes to
priority 0's (a low priority alone may get a tighter SLO and finish sooner). With fewer than
10·N completions in the window, or an index out of range, the midpoint is used.
"""

from __future__ import annotations

import bisect
from collections import deque

from pydantic import BaseModel, ConfigDict, Field


class PrioritySLOParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    midpoints: list[tuple[float, float]] = Field(
        description=(
            "per priority 0..N−1, the (TTFT s, TPOT s) midpoint of its range (the paper: its task's Table 1 SLO)"
        ),
        min_length=1,
    )
    spread: float = Field(0.25, ge=0, lt=1, description="each range is midpoint × (1 ± spread) (the paper: ±25%)")
    window: int = Field(200, ge=1, description="completed requests the windows hold (W; not given in the paper)")


class PrioritySLO:
    """Algorithm 2's state: the windows, per-priority counts, last queue time per priority."""

    def __init__(self, params: PrioritySLOParams) -> None:
        self.p = params
        self.levels = len(params.midpoints)
        self._ttft: list[tuple[float, float, int]] = []
        """Sorted (TTFT, queue time, sequence) of the window's completions."""
        self._tpot: list[tuple[float, int]] = []
        self._fifo: deque[tuple[int, tuple[float, float, int], tuple[float, int]]] = deque()
        self.counts = [0] * self.levels
        self.last_queue = [0.0] * self.levels
        self._seq = 0

    def level(self, priority: int) -> int:
        return min(max(priority, 0), self.levels - 1)

    def observe(self, priority: int, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        """A request of `priority` completed with these latencies."""
        p = self.level(priority)
        self._seq += 1
        a, b = (ttft_s, queue_s, self._seq), (tpot_s, self._seq)
        bisect.insort(self._ttft, a)
        bisect.insort(self._tpot, b)
        self._fifo.append((p, a, b))
        self.counts[p] += 1
        self.last_queue[p] = queue_s
        if len(self._fifo) > self.p.window:
            old_p, old_a, old_b = self._fifo.popleft()
            del self._ttft[bisect.bisect_left(self._ttft, old_a)]
            del self._tpot[bisect.bisect_left(self._tpot, old_b)]
            self.counts[old_p] -= 1

    def assign(self, priority: int, higher_pending: bool) -> tuple[float, float]:
        """(TTFT, TPOT) targets for a new request of `priority`."""
        p = self.level(priority)
        mid_ttft, mid_tpot = self.p.midpoints[p]
        idx = sum(self.counts[:p]) + int((p + 1) / (self.levels + 1) * self.counts[p])
        if len(self._ttft) < 10 * self.levels or idx >= len(self._ttft):
            return mid_ttft, mid_tpot
        ref_ttft, ref_queue, _ = self._ttft[idx]
        ttft = ref_ttft - (ref_queue - self.last_queue[p])
        tpot = self._tpot[idx][0]
        lo, hi = 1.0 - self.p.spread, 1.0 + self.p.spread
        floor_ttft, floor_tpot = mid_ttft * lo, mid_tpot * lo
        if not higher_pending:  # alone: the floor relaxes to the highest priority's
            top_ttft, top_tpot = self.p.midpoints[0]
            floor_ttft, floor_tpot = min(floor_ttft, top_ttft * lo), min(floor_tpot, top_tpot * lo)
        return min(max(ttft, floor_ttft), mid_ttft * hi), min(max(tpot, floor_tpot), mid_tpot * hi)
