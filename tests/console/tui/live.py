"""A real console served in the test's own process while a dashboard drives it (the live TUI tests' helper)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from console.live.config import ConsoleConfig
from console.serve import LiveConsole, run_console


def serve_while(config: ConsoleConfig, ui: Callable[[LiveConsole], Awaitable[None]]) -> None:
    """Serve a console in this process while `ui` runs against it (a dashboard in the test's own
    loop, so Pilot can drive it), then stop it through `POST /control/shutdown`; `ui`'s failure is
    the test's."""

    async def main() -> None:
        running: list[asyncio.Future[None]] = []

        def ready(live: LiveConsole) -> None:
            async def run() -> None:
                try:
                    await ui(live)
                finally:
                    token = live.token_file.read_text().strip()
                    async with httpx.AsyncClient(base_url=live.url, timeout=10) as c:
                        r = await c.post("/control/shutdown", headers={"Authorization": f"Bearer {token}"})
                        assert r.status_code == 202, r.text

            running.append(asyncio.ensure_future(run()))

        assert await run_console(config, ready) == "completed"
        await running[0]

    asyncio.run(main())
