"""Requests the queue policy holds: hold, release when there is room, expire, the retry-after hint."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from console.live.channel import Rejected
from console.live.record import Outcome
from core.types import PolicyKind

if TYPE_CHECKING:
    from core.dispatch import Dispatcher
    from core.perf import PerfProfile

WAIT_BOUND_EXPIRY = "held "
"""How the reason of a held request that SLO admission expired (past its wait bound) begins."""


class HeldQueue(Protocol):
    """What a live request asks of the requests held by the queue policy (HeldRequests)."""

    def hold(self, request_id: str, released: asyncio.Future[None]) -> None:
        """The queue policy holds the request until `released` is resolved (Rejected: it expired)."""

    def unhold(self, request_id: str) -> None:
        """The request left the queue by itself (its client went away)."""

    def release(self) -> None:
        """Let held requests go while the cluster has room."""

    def retry_after_s(self) -> float:
        """What a rejected client is told to wait."""


class HeldRequests:
    """The live requests the queue policy holds, by id: the future each one waits on is resolved here."""

    def __init__(self, dispatcher: Dispatcher, profile: PerfProfile, poll_interval_s: float) -> None:
        self.dispatcher = dispatcher
        """Holds the queue itself and its policy (which request goes first, which expires)."""
        self.profile = profile
        """The performance profile (its context length sizes the retry-after hint)."""
        self.poll_interval_s = poll_interval_s
        """How often instances are polled (a retry sooner than that sees the same cluster)."""
        self._held: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, released: asyncio.Future[None]) -> None:
        """The queue policy holds the request until `release` or `expire` resolves `released`."""
        self._held[request_id] = released

    def unhold(self, request_id: str) -> None:
        """The request left the queue by itself (its client went away)."""
        self._held.pop(request_id, None)

    def release(self) -> None:
        """Let held requests go while the cluster has room (the queue policy picks which)."""
        if not self._held:
            return
        for req in self.dispatcher.release(time.monotonic()):
            released = self._held.pop(str(req.id), None)
            if released is not None and not released.done():
                released.set_result(None)

    def expire(self) -> None:
        """Reject the held requests that waited longer than the queue policy's ttl_s, or (SLO
        admission) that could no longer start within their class's wait bound: 503, retry-after."""
        if not self._held:
            return
        now = time.monotonic()
        ttl = self.dispatcher.policies[PolicyKind.QUEUE].params.ttl_s
        gate = self.dispatcher.gate
        expired = self.dispatcher.expire(now)
        retry = self.retry_after_s() if expired else 0.0
        for req in expired:
            released = self._held.pop(str(req.id), None)
            if released is not None and not released.done():
                if gate is not None and now - req.arrival < ttl:
                    why = (
                        f"{WAIT_BOUND_EXPIRY}{now - req.arrival:.1f} s while the cluster was saturated: "
                        f"it could no longer start within its class's wait bound "
                        f"({gate.wait_bound_s(req):g} s: TTFT target + bounded wait)"
                    )
                else:
                    why = f"queued longer than the queue policy's ttl_s={ttl:g} s while every instance was saturated"
                released.set_exception(Rejected(503, why, retry, outcome=Outcome.EXPIRED))

    def retry_after_s(self) -> float:
        """What a rejected client is told to wait: with SLO admission, until a new request would
        likely be admitted; else a poll period plus the decode time of a typical request."""
        hint = self.dispatcher.retry_after_s(time.monotonic())
        if hint is not None:
            return hint
        decode_s = self.profile.max_model_len / max(self.dispatcher.view.decode_rate.value, 1.0) / 8
        return max(1.0, self.poll_interval_s + decode_s)
