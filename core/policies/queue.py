"""Queue policies, the order in which admission releases held requests: fcfs and priority."""

from __future__ import annotations

from collections import OrderedDict, deque

from core.policies.base import QueueParams, QueuePolicyBase
from core.policies.registry import register
from core.types import PolicyKind, Request


@register(PolicyKind.QUEUE, "fcfs", QueueParams, "first come, first served (arrival order)")
class Fcfs(QueuePolicyBase):
    """Releases held requests in the order they were pushed; depth is reported per SLO class."""

    def __init__(self, params: QueueParams) -> None:
        super().__init__(params)
        self._held: OrderedDict[str | int, Request] = OrderedDict()

    def push(self, request: Request, now: float) -> None:
        self._held[request.id] = request

    def pop(self, now: float) -> Request | None:
        if not self._held:
            return None
        return self._held.popitem(last=False)[1]

    def remove(self, request_id: str | int) -> Request | None:
        return self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> list[Request]:
        return list(self._held.values())

    def depth_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self._held.values():
            out[r.slo_class] = out.get(r.slo_class, 0) + 1
        return out


class _Band:
    """One priority band: a FIFO per tenant, served round-robin between tenants."""

    def __init__(self) -> None:
        self.tenants: dict[str, OrderedDict[str | int, Request]] = {}
        self.turn: deque[str] = deque()
        """Tenants with held requests, the one to serve next first."""
        self.size = 0

    def push(self, r: Request) -> None:
        fifo = self.tenants.get(r.tenant)
        if fifo is None:
            fifo = self.tenants[r.tenant] = OrderedDict()
            self.turn.append(r.tenant)
        fifo[r.id] = r
        self.size += 1

    def pop(self) -> Request:
        tenant = self.turn.popleft()
        fifo = self.tenants[tenant]
        r = fifo.popitem(last=False)[1]
        if fifo:
            self.turn.append(tenant)
        else:
            del self.tenants[tenant]
        self.size -= 1
        return r

    def remove(self, r: Request) -> None:
        fifo = self.tenants[r.tenant]
        del fifo[r.id]
        if not fifo:
            del self.tenants[r.tenant]
            self.turn.remove(r.tenant)
        self.size -= 1

    def order(self) -> list[Request]:
        """Release order without releasing: the round-robin interleave of the tenant FIFOs."""
        queues = [list(self.tenants[t].values()) for t in self.turn]
        out: list[Request] = []
        depth = 0
        while len(out) < self.size:
            out.extend(q[depth] for q in queues if depth < len(q))
            depth += 1
        return out


@register(
    PolicyKind.QUEUE,
    "priority",
    QueueParams,
    "lowest priority value first (as vLLM); round-robin between tenants inside one priority",
)
class Priority(QueuePolicyBase):
    """Strict priority between bands (lower `Request.priority` first, as in vLLM), fair inside one.

    Inside a band each tenant has its own FIFO and tenants take turns, one request each, in the
    order they first had requests held (as llm-d's flow control shares a band between flows), so
    one tenant's burst cannot starve another tenant of the same priority.
    Depth is reported per band, keyed by the priority value.
    """

    def __init__(self, params: QueueParams) -> None:
        super().__init__(params)
        self._bands: dict[int, _Band] = {}
        self._where: dict[str | int, Request] = {}

    def push(self, request: Request, now: float) -> None:
        band = self._bands.get(request.priority)
        if band is None:
            band = self._bands[request.priority] = _Band()
        band.push(request)
        self._where[request.id] = request

    def pop(self, now: float) -> Request | None:
        if not self._where:
            return None
        p = min(self._bands)
        band = self._bands[p]
        r = band.pop()
        if not band.size:
            del self._bands[p]
        del self._where[r.id]
        return r

    def remove(self, request_id: str | int) -> Request | None:
        r = self._where.pop(request_id, None)
        if r is None:
            return None
        band = self._bands[r.priority]
        band.remove(r)
        if not band.size:
            del self._bands[r.priority]
        return r

    def __len__(self) -> int:
        return len(self._where)

    def items(self) -> list[Request]:
        return [r for p in sorted(self._bands) for r in self._bands[p].order()]

    def depth_by_class(self) -> dict[str, int]:
        return {str(p): self._bands[p].size for p in sorted(self._bands)}
