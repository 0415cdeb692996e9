"""An in-process publish/subscribe bus of console events (state snapshots, swaps, instance up/down)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any


class EventBus:
    """Fan-out of dict events to any number of subscribers; slow subscribers lose the oldest."""

    def __init__(self, queue_size: int = 256, history: int = 200) -> None:
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._queue_size = queue_size
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        """Recent non-snapshot events, so a new subscriber sees what just happened."""

    def publish(self, event_type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": event_type, "time": time.time(), **fields}
        if event_type != "state":
            self.history.append(event)
        for q in list(self._subscribers):
            if q.full():
                q.get_nowait()
            q.put_nowait(event)
        return event

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self._queue_size)
        self._subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)
