"""Held-request bookkeeping of admission: who is held since when, released in the queue policy's order, expired.

The dispatcher owns one AdmissionControl (re-exported by core/admission.py) and passes it the active
queue policy and the cluster's room on every call, so a swapped queue policy takes effect at once. It
remembers when each held request was queued (for ttl_s expiry and the oldest-wait signal)
independently of the policy's order, so expiry is oldest-first whatever order the policy releases in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from core.policies.base import QueuePolicy
from core.tenants import FairShare
from core.types import Admission, Request


class AdmissionControl:
    """Held-request bookkeeping shared by the gateway and the simulator (through the dispatcher)."""

    def __init__(self) -> None:
        self.held_since: OrderedDict[Hashable, float] = OrderedDict()
        """Held request id → when it was queued, oldest first."""
        self.arrivals = 0
        """Requests seen by admit (routed, queued or shed)."""
        self.fair: FairShare | None = None
        """Release between tenants by their shares (console/live/tenants.py sets it when /v1 takes keys);
        None: in the queue policy's order."""

    def __len__(self) -> int:
        return len(self.held_since)

    def admit(self, queue: QueuePolicy, request: Request, now: float, room: int) -> Admission:
        """ROUTE if `room` > 0 and nothing is held; else QUEUED, or SHED when the queue is full."""
        self.arrivals += 1
        if room > 0 and not self.held_since:
            return Admission.ROUTE
        if len(queue) >= queue.params.max_queued:
            return Admission.SHED
        queue.push(request, now)
        self.held_since[request.id] = now
        return Admission.QUEUED

    def release(self, queue: QueuePolicy, now: float, room: int) -> list[Request]:
        """Pop up to `room` held requests in the policy's order."""
        out: list[Request] = []
        while room > 0 and self.held_since:
            r = queue.pop(now) if self.fair is None else self._pop_fair(queue)
            if r is None:
                break
            self.held_since.pop(r.id, None)
            out.append(r)
            room -= 1
        return out

    def head(self, queue: QueuePolicy) -> Request | None:
        """The held request `release` lets go next."""
        items = queue.items()
        if not items:
            return None
        return items[0] if self.fair is None else self.fair.pick(items)

    def ahead_of(self, queue: QueuePolicy, r: Request) -> float:
        """How many held requests go before `r` if it were held now: all of them in the queue policy's
        order; with a fair share, its tenant's own and what the others release meanwhile."""
        if self.fair is None or not self.held_since:
            return float(len(self.held_since))
        held: dict[str, int] = {}
        for h in queue.items():
            held[h.tenant] = held.get(h.tenant, 0) + 1
        return self.fair.ahead(held, r.tenant)

    def _pop_fair(self, queue: QueuePolicy) -> Request | None:
        assert self.fair is not None
        r = self.fair.pick(queue.items())
        if r is not None:
            queue.remove(r.id)
            self.fair.served(r)
        return r

    def expire(self, queue: QueuePolicy, now: float) -> list[Request]:
        """Remove and return the requests queued `ttl_s` ago or earlier, oldest first."""
        ttl = queue.params.ttl_s
        out: list[Request] = []
        held = self.held_since
        while held:
            rid, since = next(iter(held.items()))
            if since + ttl > now:
                break
            held.popitem(last=False)
            r = queue.remove(rid)  # type: ignore[arg-type]
            if r is not None:
                out.append(r)
        return out

    def next_expiry_at(self, queue: QueuePolicy) -> float:
        """When the oldest held request expires (inf when none is held)."""
        if not self.held_since:
            return float("inf")
        return next(iter(self.held_since.values())) + queue.params.ttl_s

    def oldest_wait(self, now: float) -> float:
        """How long the oldest held request has waited (0 when none is held)."""
        if not self.held_since:
            return 0.0
        return max(now - next(iter(self.held_since.values())), 0.0)

    def cancel(self, queue: QueuePolicy, request_id: Hashable) -> bool:
        """Drop a held request; False if it was not held."""
        if self.held_since.pop(request_id, None) is None:
            return False
        queue.remove(request_id)  # type: ignore[arg-type]
        return True

    def hand_over(self, old: QueuePolicy, new: QueuePolicy) -> None:
        """Push every request held by `old` into `new`, in old's release order, keeping queue times."""
        for r in old.items():
            new.push(r, self.held_since.get(r.id, 0.0))
