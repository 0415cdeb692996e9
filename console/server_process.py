"""Starts the console server as a process of its own, away from any terminal, and stops it again.

`up` with the dashboard and `up --detach` run the data plane (gateway, controller, backends,
recorder) in a child process in a new session: no terminal signal reaches it, and nothing it does
waits on a screen. The child says it is ready on a pipe (one JSON line: URL, run, token file, log);
its output goes to `console.log` in its run directory. An *owned* server also holds the read end of
an owner pipe: when the process that started it goes away for any reason (quit, crash, SIGKILL, its
terminal closing) the pipe reads end-of-file and the server stops, unless the owner wrote `detach`
first ("leave it running").
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from adapters.pids import running
from console.errors import ConsoleError
from console.live import discovery
from console.live.config import ConsoleConfig


class ServerStartError(ConsoleError):
    """The console server exited (or was interrupted) before it was ready."""


@dataclass
class ServerHandle:
    """A console server this process started."""

    proc: subprocess.Popen[bytes]
    url: str
    run_id: str
    token_file: Path
    log: Path
    db: Path
    banner: dict[str, object] = field(default_factory=dict)
    """Everything the server reported when ready (cluster, backend, reaped leftovers...)."""
    owner_w: int | None = None
    """Our end of the owner pipe (None once detached, or for a detached start)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def detach(self) -> None:
        """Leave the server running after this process ends."""
        if self.owner_w is not None:
            with contextlib.suppress(OSError):
                os.write(self.owner_w, b"detach\n")
                os.close(self.owner_w)
            self.owner_w = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float, progress: Callable[[float], None] | None = None) -> int | None:
        """SIGTERM (drain, stop, close the run), wait up to `timeout_s`, SIGKILL after that.
        Returns the exit code (None if it could not be reaped)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        return wait_for_exit(self.proc, timeout_s, progress)


def wait_for_exit(
    proc: subprocess.Popen[bytes], timeout_s: float, progress: Callable[[float], None] | None = None
) -> int | None:
    """Wait for `proc` to end (SIGKILL after `timeout_s`); `progress(elapsed)` about twice a second."""
    start = time.monotonic()
    while proc.poll() is None:
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            break
        if progress is not None:
            progress(elapsed)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.5)
    return proc.returncode


def stop_bound_s(config: ConsoleConfig) -> float:
    """How long a server may take to stop after SIGTERM (its own watchdog's bound, plus a margin)."""
    from console.live.shutdown import STOP_GRACE_S

    return 2 * config.drain_timeout_s + STOP_GRACE_S + 5


def spawn_server(
    config: ConsoleConfig, *, owned: bool, waiting: Callable[[float, Path], None] | None = None
) -> ServerHandle:
    """Start `sibyl-console serve` for `config` in a new session and wait until it serves.

    `owned`: the server stops when this process goes away (unless `detach`ed). `waiting(elapsed,
    log)` is called about twice a second during start-up. Ctrl-C meanwhile stops the server
    (which stops what it launched so far) and raises KeyboardInterrupt."""
    home = discovery.runs_dir()
    home.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log = home / f"starting-{stamp}.log"
    config_file = home / f"starting-{stamp}.json"
    config_file.write_text(config.model_dump_json())
    config_file.chmod(0o600)
    ready_r, ready_w = os.pipe()
    owner_r, owner_w = os.pipe() if owned else (None, None)
    cmd = [
        sys.executable,
        "-m",
        "console.cli",
        "serve",
        "--config",
        str(config_file),
        "--ready-fd",
        str(ready_w),
        "--log",
        str(log),
    ]
    if owner_r is not None:
        cmd += ["--owner-fd", str(owner_r)]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tuple(fd for fd in (ready_w, owner_r) if fd is not None),
        )
    os.close(ready_w)
    if owner_r is not None:
        os.close(owner_r)
    try:
        line = _read_ready(proc, ready_r, log, waiting)
    except BaseException:
        if owner_w is not None:
            os.close(owner_w)  # an owned server stops on this too
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            wait_for_exit(proc, stop_bound_s(config))
        raise
    finally:
        os.close(ready_r)
        config_file.unlink(missing_ok=True)
    info = json.loads(line)
    return ServerHandle(
        proc,
        str(info["url"]),
        str(info["run_id"]),
        Path(str(info["token_file"])),
        Path(str(info["log"])),
        Path(str(info["db"])),
        info,
        owner_w,
    )


def _read_ready(
    proc: subprocess.Popen[bytes], fd: int, log: Path, waiting: Callable[[float, Path], None] | None
) -> str:
    start, data = time.monotonic(), b""
    while b"\n" not in data:
        readable, _, _ = select.select([fd], [], [], 0.5)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
        if waiting is not None:
            waiting(time.monotonic() - start, log)
    if b"\n" not in data:
        wait_for_exit(proc, 10)
        if said := _error_line(log):
            raise ServerStartError(f"{said} (log: {log})")
        raise ServerStartError(
            f"the console server exited before it was ready (exit {proc.returncode}); "
            f"the end of its log {log}:\n{_tail(log)}"
        )
    return data.split(b"\n", 1)[0].decode()


def _error_line(log: Path) -> str | None:
    """The one-line error the server printed before exiting (a SibylError: a taken port, a bad
    policy...), when that is how its log ends."""
    try:
        last = log.read_text(errors="replace").rstrip().splitlines()[-1:]
    except OSError:
        return None
    prefix = "sibyl-console: error: "
    return last[0].removeprefix(prefix) if last and last[0].startswith(prefix) else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty)"


def say_ready(fd: int, info: dict[str, object]) -> None:
    """The server's side: one JSON line on the ready pipe, then close it."""
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps(info).encode() + b"\n")
    with contextlib.suppress(OSError):
        os.close(fd)


def stop_local(
    address: discovery.ConsoleAddress, timeout_s: float, progress: Callable[[float], None] | None = None
) -> bool:
    """SIGTERM a local console by its pid and wait until it is gone; False if it outlived `timeout_s`."""
    if address.pid is None:
        raise ConsoleError(f"the console at {address.url} did not say its pid; stop it with POST /control/shutdown")
    with contextlib.suppress(ProcessLookupError):
        os.kill(address.pid, signal.SIGTERM)
    start = time.monotonic()
    while running(address.pid):
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            return False
        if progress is not None:
            progress(elapsed)
        time.sleep(0.25)
    return True
