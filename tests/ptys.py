"""A real pseudo-terminal for end-to-end tests of the dashboard: read it, freeze it, close it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path


class Terminal:
    """A process on the slave side of a pty that is its controlling terminal; we hold the master.

    A reader thread drains the master into `output` until `freeze()` (then the process's writes
    back up, as they do behind a stalled SSH link or a stopped tmux server); `close()` hangs the
    terminal up (SIGHUP to the session, as when a terminal window or tmux session is killed)."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str], cwd: Path, cols: int = 160, rows: int = 48) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

        def controlling_tty() -> None:  # runs in the child after setsid: the slave becomes its terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            list(cmd),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env={**env, "TERM": "xterm-256color"},
            start_new_session=True,
            preexec_fn=controlling_tty,
        )
        os.close(slave)
        self.output = bytearray()
        self._lock = threading.Lock()
        self._reading = threading.Event()
        self._reading.set()
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            if not self._reading.wait(0.1):
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the slave side is gone
                return
            if not chunk:
                return
            with self._lock:
                self.output += chunk

    def text(self) -> str:
        with self._lock:
            return self.output.decode(errors="replace")

    def wait_for_text(self, needle: str, timeout: float = 30.0, start: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text()[start:]:
            if self.proc.poll() is not None and needle not in self.text()[start:]:
                raise AssertionError(
                    f"the process exited ({self.proc.returncode}) before showing {needle!r}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not shown within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 3000) -> str:
        return self.text()[-n:]

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def freeze(self) -> None:
        """Stop reading: what the process writes piles up until its writes block."""
        self._reading.clear()

    def thaw(self) -> None:
        self._reading.set()

    def pending(self) -> int:
        """Bytes written by the process and not read by us (the backed-up output of a frozen terminal)."""
        buf = fcntl.ioctl(self.master, termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("i", buf)[0])

    def close(self) -> None:
        """Hang up: close the master side."""
        if not self._closed:
            self._closed = True
            self._reading.set()
            with contextlib.suppress(OSError):
                os.close(self.master)

    def kill(self) -> None:
        """Test clean-up: the whole session, whatever state it is in."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.close()
