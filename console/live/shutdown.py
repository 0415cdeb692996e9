"""One shutdown for a console server: signals, a gone owner, or the control API start it; a bound ends it.

Whatever asks first (SIGINT, SIGTERM, SIGHUP, the dashboard process that owns the server going away,
`POST /control/shutdown`) starts a graceful stop: the gateway stops accepting, in-flight requests
drain for up to `drain_timeout_s`, the backend stops what it launched and the run is closed. A second
request of any kind stops at once (no drain; the run is marked interrupted). A watchdog thread, armed
by the first request and independent of the event loop, ends the process if the stop has not finished
within the drain bound plus a grace period, so a stuck loop can never keep a console alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from adapters.serving import SHUTDOWN_SIGNALS

STOP_GRACE_S = 20.0
"""Beyond the drain bound: time for the backend to stop its instances and the run to be closed."""


class Shutdown:
    """Graceful first, forced second, bounded always."""

    def __init__(
        self,
        server: uvicorn.Server,
        *,
        drain_timeout_s: float,
        on_first: Callable[[], None] | None = None,
        db: Path | None = None,
        run_id: str | None = None,
    ) -> None:
        self.server = server
        self.drain_timeout_s = drain_timeout_s
        self.on_first = on_first
        """Called once, on the first request (e.g. stop a running replay)."""
        self.reason: str | None = None
        """What started the stop (e.g. "SIGTERM", "owner gone", "control API")."""
        self.forced = False
        """A second request came: the stop skipped the drain."""
        self._db, self._run_id = db, run_id
        self._watchdog: threading.Timer | None = None

    @property
    def bound_s(self) -> float:
        """How long a stop may take before the watchdog ends the process: the gateway's drain, the
        controller's (normally instant after it), and the grace for stopping instances."""
        return 2 * self.drain_timeout_s + STOP_GRACE_S

    def request(self, reason: str) -> None:
        """Start the graceful stop, or force it when one is already under way. Call on the event loop."""
        if self.reason is None:
            self.reason = reason
            self.server.should_exit = True
            self._arm_watchdog()
            if self.on_first is not None:
                self.on_first()
        else:
            self.forced = True
            self.server.should_exit = True
            self.server.force_exit = True

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM/SIGHUP on the running loop call `request`."""
        import asyncio

        loop = asyncio.get_running_loop()
        for sig in SHUTDOWN_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request, signal.Signals(sig).name)

    def watch_owner(self, fd: int) -> None:
        """Stop when the process at the other end of pipe `fd` goes away, unless it said `detach` first."""
        import asyncio

        loop = asyncio.get_running_loop()

        def follow() -> None:
            detached = False
            while True:
                try:
                    chunk = os.read(fd, 64)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                detached = detached or b"detach" in chunk
            with contextlib.suppress(OSError):
                os.close(fd)
            if not detached:
                with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing left to stop
                    loop.call_soon_threadsafe(self.request, "the dashboard that started this console went away")

        threading.Thread(target=follow, name="owner-watch", daemon=True).start()

    def disarm(self) -> None:
        """The stop finished in time."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _arm_watchdog(self) -> None:
        self._watchdog = threading.Timer(self.bound_s, self._hard_exit)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _hard_exit(self) -> None:
        print(
            f"sibyl-console: the stop ({self.reason}) did not finish within {self.bound_s:.0f} s; exiting now "
            "(launched instances stop by their parent-death signal)",
            file=sys.stderr,
            flush=True,
        )
        if self._db is not None and self._run_id is not None:
            with contextlib.suppress(sqlite3.Error), sqlite3.connect(self._db, timeout=2.0) as conn:
                conn.execute(
                    "UPDATE runs SET status = 'interrupted', ended_at = ? WHERE run_id = ? AND status = 'running'",
                    (time.time(), self._run_id),
                )
        os._exit(70)
