"""A text prompt is tokenized by a prefill instance's /tokenize; an instance without one is asked once, then skipped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from console.live.prefix import engine_token_ids


async def serve(status: int, seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """A stand-in engine on a free loopback port whose /tokenize answers `status` (ids [7, 8, 9] on 200)."""

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if status == 200:
            return web.json_response({"tokens": [7, 8, 9], "count": 3})
        return web.json_response({"detail": "Not Found"}, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_an_instance_without_tokenize_is_asked_once_and_the_next_one_tokenizes() -> None:
    async def go() -> None:
        no_route: list[dict[str, Any]] = []
        ok: list[dict[str, Any]] = []
        r1, url1 = await serve(404, no_route)
        r2, url2 = await serve(200, ok)
        async with aiohttp.ClientSession(base_url=url1) as s1, aiohttp.ClientSession(base_url=url2) as s2:
            p0 = SimpleNamespace(id="p0", healthy=True, session=s1)
            p1 = SimpleNamespace(id="p1", healthy=True, session=s2)
            without: set[str] = set()
            body = {"prompt": "hello there"}
            assert await engine_token_ids(body, [p0, p1], without) == [7, 8, 9]  # type: ignore[list-item]
            assert without == {"p0"}
            assert await engine_token_ids(body, [p0, p1], without) == [7, 8, 9]  # type: ignore[list-item]
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            assert await engine_token_ids(chat, [p0, p1], without) == [7, 8, 9]  # type: ignore[list-item]
        await r1.cleanup()
        await r2.cleanup()
        assert no_route == [{"prompt": "hello there"}]  # asked once, never again
        assert ok == [{"prompt": "hello there"}, {"prompt": "hello there"}, {"messages": chat["messages"]}]

    asyncio.run(go())


def test_a_failing_tokenize_is_not_taken_for_a_missing_one() -> None:
    async def go() -> None:
        seen: list[dict[str, Any]] = []
        runner, url = await serve(500, seen)
        async with aiohttp.ClientSession(base_url=url) as s:
            p0 = SimpleNamespace(id="p0", healthy=True, session=s)
            without: set[str] = set()
            assert await engine_token_ids({"prompt": "x"}, [p0], without) is None  # type: ignore[list-item]
            assert await engine_token_ids({"prompt": "x"}, [p0], without) is None  # type: ignore[list-item]
            assert without == set()
        await runner.cleanup()
        assert len(seen) == 2

    asyncio.run(go())
