"""Per-instance circuit breakers: stop routing to an instance whose requests keep failing.

A health probe can pass while every request fails (an engine that answers /health but 500s every
generation). After `failures` consecutive request failures the breaker opens: the instance is
taken out of routing. After `cooloff_s` it half-opens: the instance is routable again and the
next request decides — a success closes the breaker, a failure opens it for another cool-off
(as SGLang's gateway does).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """The breaker of one instance; the controller feeds it outcomes and the time."""

    failures: int = 5
    """Consecutive failures that open it."""
    cooloff_s: float = 10.0
    """How long it stays open before one request may try again."""
    state: BreakerState = BreakerState.CLOSED
    consecutive: int = 0
    opened_at: float = 0.0

    @property
    def allows(self) -> bool:
        """Whether requests may be routed to the instance."""
        return self.state != BreakerState.OPEN

    def success(self) -> BreakerState | None:
        """A request succeeded on the instance; returns the new state if it changed."""
        self.consecutive = 0
        if self.state != BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            return self.state
        return None

    def failure(self, now: float) -> BreakerState | None:
        """A request failed because of the instance; returns the new state if it changed."""
        self.consecutive += 1
        if self.state == BreakerState.HALF_OPEN or (
            self.state == BreakerState.CLOSED and self.consecutive >= self.failures
        ):
            self.state = BreakerState.OPEN
            self.opened_at = now
            return self.state
        return None

    def tick(self, now: float) -> BreakerState | None:
        """Half-open once the cool-off has passed; returns the new state if it changed."""
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.cooloff_s:
            self.state = BreakerState.HALF_OPEN
            return self.state
        return None
