"""What SLO admission counts and learns: refusals by the limit they hit, the measured-over-projected TTFT drift."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class RefusalCause(StrEnum):
    """Which limit a refused request hit (an arrival answered 429, a held one answered 503)."""

    PREFILL_BACKLOG = "prefill_backlog"
    """Its first token would come out of every prefill instance too late."""
    DECODE_SLOTS = "decode_slots"
    """No decode slot would free up in time (slots from max_num_seqs and the TPOT target, or the
    engines' own waiting queues)."""
    KV = "kv"
    """No decode slot in time, and a decode engine reports its KV cache full (kv_high)."""
    QUEUE_FULL = "queue_full"
    """The gateway's queue already holds max_queued requests."""
    TENANT_LIMIT = "tenant_limit"
    """The tenant's own limit (counted by the gateway's tenant table through `count_refusal`)."""


@dataclass
class Refusals:
    """Refusals of one cause: how many, and the last one's projected start against its bound."""

    count: int = 0
    last_projected_s: float = 0.0
    """Seconds after its arrival the last refused request was projected to start."""
    bound_s: float = 0.0
    """The bound it was held to: at arrival headroom × its class's TTFT target + the bounded wait,
    when held its wait bound (TTFT target + bounded wait)."""


class TtftDrift:
    """Measured over projected TTFT per prefill instance: the feedback that corrects the projection.

    A ratio of exponentially weighted sums (Σ measured / Σ projected, so a long wait weighs more
    than a short one), applied once `min_samples` requests have finished there, bounded to
    [`low`, `high`]: a projection that drifts from what the engine does is scaled back towards it,
    and no burst of outliers can make it refuse everything or nothing."""

    def __init__(self, alpha: float = 0.05, low: float = 0.5, high: float = 4.0, min_samples: int = 8) -> None:
        self.alpha = alpha
        self.low, self.high = low, high
        self.min_samples = min_samples
        self.measured = np.zeros(0)
        self.projected = np.zeros(0)
        self.samples = np.zeros(0, dtype=np.int64)
        self.ratio = np.ones(0)

    def _grow(self, n: int) -> None:
        k = n - len(self.ratio)
        if k > 0:
            self.measured = np.append(self.measured, np.zeros(k))
            self.projected = np.append(self.projected, np.zeros(k))
            self.samples = np.append(self.samples, np.zeros(k, dtype=np.int64))
            self.ratio = np.append(self.ratio, np.ones(k))

    def observe(self, p: int, projected_s: float, measured_s: float) -> None:
        if projected_s <= 0 or measured_s <= 0:
            return
        self._grow(p + 1)
        a = self.alpha
        self.measured[p] += a * (measured_s - self.measured[p])
        self.projected[p] += a * (projected_s - self.projected[p])
        self.samples[p] += 1
        if self.samples[p] >= self.min_samples:
            self.ratio[p] = min(max(self.measured[p] / self.projected[p], self.low), self.high)

    def of(self, n: int) -> np.ndarray:
        """The ratio per instance index (1 where nothing is known)."""
        self._grow(n)
        return self.ratio[:n]
