"""Start the dashboard, always a client of a console server: for `up` (which started the server) or `tui`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console

from console.server_process import ServerHandle
from console.tui.client import DashboardClient

if TYPE_CHECKING:
    from console.tui.app import SibylDashboard

_LOGGERS = ("", "uvicorn", "uvicorn.access")


class _IntoEventLog(logging.Handler):
    """Log records (uvicorn's warnings...) become event-log lines instead of scribbling on the screen."""

    def __init__(self, app: SibylDashboard, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(logging.WARNING)
        self.app, self.loop = app, loop

    def emit(self, record: logging.LogRecord) -> None:
        from console.tui.messages import ConsoleEvent

        event = {
            "type": "note",
            "time": time.time(),
            "message": f"{record.name}: {record.getMessage()}",
            "style": "yellow",
        }
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.app.post_message, ConsoleEvent(event))


@contextlib.contextmanager
def _logs_into(app: SibylDashboard) -> Iterator[None]:
    handler = _IntoEventLog(app, asyncio.get_running_loop())
    removed: list[tuple[logging.Logger, logging.Handler]] = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (
                sys.stderr,
                sys.stdout,
                sys.__stderr__,
                sys.__stdout__,
            ):
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


async def run_dashboard(
    url: str, token: str | None, *, owns_cluster: bool, server_alive: Callable[[], bool] | None = None
) -> str | None:
    """Run the dashboard in the current event loop until the operator quits; returns the quit
    choice ("stop", "leave", or None for a plain quit or a console that went away).

    `server_alive`: for a dashboard that launched the console, whether its server process still
    runs; when it ends the dashboard closes (returning "gone")."""
    # Textual is heavy: load it only when a dashboard runs.
    from console.tui.app import SibylDashboard

    client = DashboardClient(url, token)
    app = SibylDashboard(client, owns_cluster=owns_cluster)

    async def follow_server() -> None:
        assert server_alive is not None
        while server_alive():
            await asyncio.sleep(0.5)
        app.exit("gone")

    watcher = asyncio.ensure_future(follow_server()) if server_alive is not None else None
    try:
        with _logs_into(app):
            result = await app.run_async()
    finally:
        if watcher is not None:
            watcher.cancel()
        await client.aclose()
    return result if isinstance(result, str) else None


def _terminal_loss_ends_this_process() -> None:
    """SIGHUP and SIGTERM end the dashboard process at once (the kernel's default action): nothing
    here needs cleaning up, the console server is another process that stops when our owner pipe
    closes, and a Python-level handler could not run while Textual's writer is blocked on a
    terminal that stopped reading."""
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def run_owned_dashboard(handle: ServerHandle, stop_bound_s: float, out: Console) -> None:
    """`up`'s dashboard: a client of the server `up` just started; on quit stop it or leave it running."""
    _terminal_loss_ends_this_process()
    token = handle.token_file.read_text().strip()
    try:
        choice = asyncio.run(run_dashboard(handle.url, token, owns_cluster=True, server_alive=handle.alive))
    except BaseException:
        handle.stop(stop_bound_s)
        raise
    if choice == "leave":
        handle.detach()
        out.print(f"left running: run {handle.run_id}, pid {handle.pid}, {handle.url}")
        out.print(f"  reattach    sibyl-console tui --run {handle.run_id}")
        out.print(f"  stop        sibyl-console down {handle.run_id}")
        out.print(f"  log         {handle.log}")
        return
    if handle.alive():
        with out.status("draining and stopping the cluster...") as status:
            code = handle.stop(stop_bound_s, lambda t: status.update(f"draining and stopping the cluster... {t:.0f} s"))
    else:
        code = handle.proc.returncode
    out.print(
        f"stopped; run {handle.run_id} {run_status(handle)}"
        + ("" if code == 0 else f" (server exit {code}, log {handle.log})")
    )


def run_status(handle: ServerHandle) -> str:
    """The run's status as the store has it."""
    from adapters.store import RunStore

    try:
        store = RunStore(handle.db)
        try:
            return store.get_run(handle.run_id).status
        finally:
            store.close()
    except Exception as e:  # the store is the server's; report, do not fail the exit
        return f"(status unknown: {e})"
