"""The client channel's disconnect watcher, against an ASGI server's receive as the spec has it."""

from __future__ import annotations

import asyncio
from typing import Any

from console.live.channel import ClientChannel


class Connection:
    """An ASGI connection's two callables: `receive` waits until the response is complete or the
    client leaves, then answers http.disconnect (as uvicorn does, and the ASGI spec asks)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.over = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.over.set()

    async def receive(self) -> dict[str, Any]:
        await self.over.wait()
        return {"type": "http.disconnect"}


def test_a_complete_responses_watcher_ends_by_itself_and_an_open_ones_is_cancelled() -> None:
    async def scenario() -> None:
        conn = Connection()
        done = ClientChannel(conn.send, conn.receive)
        done.watch()
        watcher = done._watcher
        assert watcher is not None
        await done.start_stream("r1")
        await done.write(b"data: 1\n\n")
        await done.end(b"data: [DONE]\n\n")
        done.close()
        await asyncio.wait_for(watcher, 1)
        assert watcher.done() and not watcher.cancelled()  # no CancelledError cycle left behind

        other = Connection()
        cut = ClientChannel(other.send, other.receive)
        cut.watch()
        pending = cut._watcher
        assert pending is not None
        await cut.start_stream("r2")  # the gateway gives up before the response is complete
        cut.close()
        await asyncio.wait([pending], timeout=1)
        assert pending.cancelled() and not cut.gone.is_set()

    asyncio.run(scenario())
