"""The gateway's hot-path HTTP client against a raw asyncio server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from adapters.http.upstream import UpstreamClosed, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head, await reader.readexactly(length)


async def serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server on a free loopback port; `connections` counts the TCP connections it accepted."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            await handler(reader, writer, len(connections) - 1)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def test_keep_alive_reuses_one_connection_and_streams_chunks_as_they_arrive() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            head, _ = await read_request(reader)
            assert b"POST /v1/completions HTTP/1.1" in head and b"X-Request-Id: r1" in head
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"data: a\n\n", b"data: b\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def body() -> None:
        server, url, connections = await serve(handler)
        pool = UpstreamPool(url)
        for _ in range(3):
            async with await pool.post("/v1/completions", b"{}", b"X-Request-Id: r1\r\n") as r:
                assert r.status == 200
                assert [c async for c in r.iter_chunks()] == [b"data: a\n\n", b"data: b\n\n"]
        assert len(connections) == 1
        pool.close()
        server.close()

    asyncio.run(body())


def test_a_pooled_connection_the_server_closed_is_replaced_without_losing_the_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + n, body + b"!" * n))
        await writer.drain()
        # then close the idle keep-alive connection, as uvicorn does after its keep-alive timeout

    async def body() -> None:
        server, url, connections = await serve(handler)
        pool = UpstreamPool(url)
        async with await pool.post("/p", b"one") as r:
            assert await r.read() == b"one"
        await asyncio.sleep(0.05)  # the server has closed it meanwhile
        async with await pool.post("/p", b"two") as r:
            assert await r.read() == b"two!"
        assert len(connections) == 2
        pool.close()
        server.close()

    asyncio.run(body())


def test_a_connection_dropped_mid_body_raises_and_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            return  # gone mid-stream
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy")
        await writer.drain()

    async def body() -> None:
        server, url, connections = await serve(handler)
        pool = UpstreamPool(url)
        r = await pool.post("/p", b"{}")
        chunks = []
        with pytest.raises(UpstreamClosed, match="before the response was complete"):
            async for c in r.iter_chunks():
                chunks.append(c)
        r.release()
        assert chunks == [b"hello"]
        async with await pool.post("/p", b"{}") as r:
            assert (r.status, await r.read()) == (503, b"busy")
        assert len(connections) == 2 and not pool._idle  # "Connection: close" is honoured
        pool.close()
        server.close()

    asyncio.run(body())


def test_nothing_listening_is_a_connection_error() -> None:
    async def body() -> None:
        server, url, _ = await serve(lambda r, w, n: asyncio.sleep(0))
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await UpstreamPool(url).post("/p", b"{}")
        with pytest.raises(ValueError, match="not an http"):
            UpstreamPool("ftp://x")

    asyncio.run(body())
