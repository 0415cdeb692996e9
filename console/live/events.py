"""In-process events: the bus of console events the control API streams, and the instance listeners."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance


class EventBus:
    """Fan-out of dict events to any number of subscribers; slow subscribers lose the oldest."""

    def __init__(self, queue_size: int = 256, history: int = 200) -> None:
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._queue_size = queue_size
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        """Recent non-snapshot events, so a new subscriber sees what just happened."""
        self.closed = False
        """Set by `close`: the console is stopping and every subscription has ended."""

    def publish(self, event_type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": event_type, "time": time.time(), **fields}
        if event_type != "state":
            self.history.append(event)
        for q in list(self._subscribers):
            if q.full():
                q.get_nowait()
            q.put_nowait(event)
        return event

    @property
    def subscribers(self) -> int:
        """How many subscriptions are open (event streams being followed)."""
        return len(self._subscribers)

    def close(self, event_type: str = "stopping", **fields: Any) -> None:
        """Publish a last event, then end every subscription (so open event streams let a stopping
        server finish instead of holding its connections open until the drain bound)."""
        if self.closed:
            return
        self.publish(event_type, **fields)
        self.closed = True
        for q in list(self._subscribers):
            if q.full():
                q.get_nowait()
            q.put_nowait(_END)

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        if self.closed:
            return
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self._queue_size)
        self._subscribers.add(q)
        try:
            while True:
                event = await q.get()
                if event is _END:
                    return
                yield event
        finally:
            self._subscribers.discard(q)


_END: dict[str, Any] = {"type": "end"}
"""The sentinel `close` puts on every subscriber's queue."""


class InstanceListeners:
    """Who hears that an instance joined the cluster, went down or left it; the parts subscribe once, at
    wiring time (the controller), and whoever sees the change tells the list (the scaler, health)."""

    def __init__(self) -> None:
        self._added: list[Callable[[Instance], None]] = []
        self._down: list[Callable[[str], None]] = []
        self._removed: list[Callable[[str], None]] = []

    def subscribe(
        self,
        *,
        added: Callable[[Instance], None] | None = None,
        down: Callable[[str], None] | None = None,
        removed: Callable[[str], None] | None = None,
    ) -> None:
        """Call `added` with each instance that joined, `down` and `removed` with the id of each that went
        down or left (in the order of subscription)."""
        if added is not None:
            self._added.append(added)
        if down is not None:
            self._down.append(down)
        if removed is not None:
            self._removed.append(removed)

    def added(self, inst: Instance) -> None:
        """A started instance joined the cluster and is routable."""
        for listener in self._added:
            listener(inst)

    def down(self, instance_id: str) -> None:
        """The poller or the backend marked the instance down."""
        for listener in self._down:
            listener(instance_id)

    def removed(self, instance_id: str) -> None:
        """The instance left the cluster."""
        for listener in self._removed:
            listener(instance_id)
