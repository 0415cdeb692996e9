"""The replayer's pooled connections: reused while briefly idle, never past `REUSE_IDLE_S`, so that no request is
written into a connection the server is closing (uvicorn closes idle ones after 5 s)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn

from adapters.ports import free_port
from console.offline import replay as replay_module
from console.offline.replay import Replayer

ONE_TOKEN_STREAM = b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n'


class ConnectionRecorder:
    """An ASGI completions endpoint that streams one token and records each request's client port (one per
    TCP connection)."""

    def __init__(self) -> None:
        self.ports: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.ports.append(scope["client"][1])
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": ONE_TOKEN_STREAM})


async def replay_against_recorder(arrivals: list[float]) -> list[int]:
    app = ConnectionRecorder()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        rep = Replayer(arrivals, [8] * len(arrivals), [1] * len(arrivals), f"http://127.0.0.1:{port}")
        await rep.run()
        assert rep.stats.done == len(arrivals) and rep.stats.failed == 0, rep.stats
    finally:
        server.should_exit = True
        await serving
    return app.ports


def test_a_connection_idle_past_the_reuse_limit_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests at 0, 0.4 and 2.4 s with the limit at 1.2 s: the second reuses the first's connection (idle ~0.4 s),
    the third opens a new one (idle ~2 s)."""
    monkeypatch.setattr(replay_module, "REUSE_IDLE_S", 1.2)
    ports = asyncio.run(replay_against_recorder([0.0, 0.4, 2.4]))
    assert len(ports) == 3
    assert ports[0] == ports[1], ports
    assert ports[2] != ports[1], ports
