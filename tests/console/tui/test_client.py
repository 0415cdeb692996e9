"""The dashboard's control-API client against a real server that closes kept-alive connections."""

from __future__ import annotations

import asyncio
import json

import pytest

from console.tui.client import ConnectionLost, DashboardClient


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
