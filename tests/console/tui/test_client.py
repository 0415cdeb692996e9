"""The dashboard's control-API client: against the fake control API (state, catalog, swaps, errors, SSE), and
against a real server that closes kept-alive connections."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from console.tui.client import ApiError, ConnectionLost, DashboardClient
from tests.console.tui.fakes import TOKEN, FakeConsole, free_port, served


class OneRequestPerConnection:
    """An HTTP/1.1 server on 127.0.0.1 that answers the first request of each connection with
    keep-alive, then reads the next request on it and closes without answering: what a server's
    keep-alive timeout closing a pooled connection just as the client reuses it looks like."""

    def __init__(self) -> None:
        self.answered: list[str] = []
        """The request line of every request answered, in order."""
        self.dropped: list[str] = []
        """The request line of every request the server closed the connection on."""
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @staticmethod
    async def _request_line(reader: asyncio.StreamReader) -> str:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        for header in head.split("\r\n")[1:]:
            name, _, value = header.partition(":")
            if name.strip().lower() == "content-length":
                await reader.readexactly(int(value))
        return head.split("\r\n", 1)[0]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await self._request_line(reader)
            body = json.dumps({"requests": [{"request_id": "r1"}], "line": line}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            self.answered.append(line)
            self.dropped.append(await self._request_line(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_a_get_on_a_connection_the_server_closed_is_sent_again_once() -> None:
    async def body() -> None:
        server = OneRequestPerConnection()
        async with server as url:
            client = DashboardClient(url, "token")
            first = await client.instance_requests("p0")
            second = await client.instance_requests("p0")  # reuses the pooled connection the server drops
            await client.aclose()
        assert first["requests"] == second["requests"] == [{"request_id": "r1"}]
        line = "GET /control/instances/p0/requests?limit=100 HTTP/1.1"
        assert server.answered == [line, line] and server.dropped == [line]

    asyncio.run(body())


def test_a_post_is_not_sent_twice() -> None:
    async def body() -> None:
        server = OneRequestPerConnection()
        async with server as url:
            client = DashboardClient(url, "token")
            await client.scale("decode", 1)
            with pytest.raises(ConnectionLost, match="RemoteProtocolError"):
                await client.scale("decode", 1)
            await client.aclose()
        assert server.answered == ["POST /control/scale HTTP/1.1"] == server.dropped

    asyncio.run(body())


def test_state_and_catalog() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        c = fake.client()
        s = await c.state()
        assert [i.id for i in s.instances] == ["p0", "d0", "d1"]
        cat = await c.policies()
        assert {p["name"] for p in cat["available"]} >= {"least_load", "sibyl", "static"}
        await c.aclose()

    asyncio.run(body())


def test_set_policy_records_source_and_maps_422() -> None:
    async def body() -> None:
        fake = FakeConsole()
        c = fake.client()
        r = await c.set_policy("routing", "least_load", {"by": "tokens"})
        assert r == {
            "kind": "routing",
            "old": "sibyl",
            "new": "least_load",
            "params": {"by": "tokens"},
            "source": "tui",
        }
        with pytest.raises(ApiError) as e:
            await c.set_policy("routing", "least_load", {"by": "bytes"})
        assert e.value.status == 422 and "by: Input should be" in e.value.message
        await c.aclose()

    asyncio.run(body())


def test_errors_become_connection_lost_or_api_error() -> None:
    async def body() -> None:
        fake = FakeConsole()
        bad = fake.client(token="wrong")
        with pytest.raises(ApiError) as e:
            await bad.state()
        assert e.value.status == 401
        fake.down = True
        with pytest.raises(ConnectionLost):
            await fake.client().state()
        refused = DashboardClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout_s=1.0)
        with pytest.raises(ConnectionLost):
            await refused.state()
        await refused.aclose()

    asyncio.run(body())


def test_sse_over_real_http() -> None:
    async def body() -> None:
        fake = FakeConsole()
        fake.publish("policy", kind="routing", old="round_robin", new="sibyl", params={}, source="cli", t=1.0)
        async with served(fake) as url:
            c = DashboardClient(url, TOKEN)
            stream = c.events()
            first = await asyncio.wait_for(stream.__anext__(), 5)
            assert first["type"] == "policy" and first["source"] == "cli"
            snapshot = await asyncio.wait_for(stream.__anext__(), 5)
            assert snapshot["type"] == "state" and len(snapshot["state"]["instances"]) == 6
            fake.set_health("d1", False)
            second = await asyncio.wait_for(stream.__anext__(), 5)
            assert second == {**second, "type": "instance", "instance": "d1", "event": "down"}
            await stream.aclose()
            r = await c.set_policy("routing", "round_robin", {})
            assert r["new"] == "round_robin"
            await c.aclose()

    asyncio.run(body())


def test_cli_and_launcher_defer_textual() -> None:
    """`sibyl-console tui --help` and `up --headless` must not pay for importing Textual."""
    code = "import sys, console.commands.tui, console.tui.launch; print('textual' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "False"
