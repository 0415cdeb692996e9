"""Start the dashboard: in-process for `up` (owns the cluster) or attached for `sibyl-console tui`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from console.tui.client import DashboardClient

if TYPE_CHECKING:
    from console.serve import LiveConsole
    from console.tui.app import SibylDashboard

_LOGGERS = ("", "uvicorn", "uvicorn.access")


class _IntoEventLog(logging.Handler):
    """Log records (uvicorn's warnings...) become event-log lines instead of scribbling on the screen."""

    def __init__(self, app: SibylDashboard, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(logging.WARNING)
        self.app, self.loop = app, loop

    def emit(self, record: logging.LogRecord) -> None:
        from console.tui.messages import ConsoleEvent

        event = {"type": "note", "time": time.time(), "message": f"{record.name}: {record.getMessage()}", "style": "yellow"}
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.app.post_message, ConsoleEvent(event))


@contextlib.contextmanager
def _logs_into(app: SibylDashboard) -> Iterator[None]:
    handler = _IntoEventLog(app, asyncio.get_running_loop())
    removed: list[tuple[logging.Logger, logging.Handler]] = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__):
                logger.removeHandler(h)
                removed.append((logger, h))
        logger.addHandler(handler)
    try:
        yield
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        for logger, h in removed:
            logger.addHandler(h)


async def run_dashboard(url: str, token: str | None, *, owns_cluster: bool) -> None:
    """Run the dashboard in the current event loop until the operator quits."""
    # Textual is heavy: load it only when a dashboard runs.
    from console.tui.app import SibylDashboard

    client = DashboardClient(url, token)
    app = SibylDashboard(client, owns_cluster=owns_cluster)
    try:
        with _logs_into(app):
            await app.run_async()
    finally:
        await client.aclose()


async def dashboard_for(live: LiveConsole) -> None:
    """`up`'s UI: the dashboard of the console just started; returning stops that console."""
    token = live.token_file.read_text().strip()
    await run_dashboard(live.url, token, owns_cluster=True)
