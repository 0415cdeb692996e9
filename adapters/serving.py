"""uvicorn servers that share one event loop and one graceful shutdown on SIGINT/SIGTERM.

uvicorn's own handler re-raises the signal once `serve()` returns, which would end the process
before the caller's cleanup (stopping child processes, closing the run record) could run.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Generator, Iterable

import uvicorn


class ManagedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `on_shutdown_signals`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, a polite kill, and the terminal going away (an SSH session dropped, tmux killed)."""


def on_shutdown_signals(servers: Iterable[uvicorn.Server], also: Callable[[], None] | None = None) -> None:
    """First SIGINT/SIGTERM/SIGHUP: graceful exit of every server; a second SIGINT forces it."""
    loop = asyncio.get_running_loop()
    targets = list(servers)

    def handle(sig: signal.Signals) -> None:
        for s in targets:
            if s.should_exit and sig == signal.SIGINT:
                s.force_exit = True
            s.should_exit = True
        if also is not None:
            also()

    for sig in SHUTDOWN_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handle, sig)
