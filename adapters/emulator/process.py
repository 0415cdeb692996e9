"""Start emulator processes on 127.0.0.1, wait until they answer /health, stop them by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.errors import SibylError

ROOT = Path(__file__).resolve().parents[2]


class EmulatorStartError(SibylError):
    """An emulator process exited or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EmulatorProcess:
    role: str
    port: int
    args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> EmulatorProcess:
        cmd = [sys.executable, "-m", "adapters.emulator", "--role", self.role, "--port", str(self.port), "--host", self.host, *self.args]
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise EmulatorStartError(f"emulator {self.role} on port {self.port} exited with {self.proc.returncode}{self._log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        return
                time.sleep(0.05)
        raise EmulatorStartError(f"emulator {self.role} on port {self.port} not healthy after {timeout_s:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
            return ":\n  " + "\n  ".join(lines) if lines else ""
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, like a crash."""
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start_many(specs: list[tuple[str, list[str]]], log_dir: Path | None = None, timeout_s: float = 30.0) -> list[EmulatorProcess]:
    """Start every (role, extra args) on free ports, wait for all; on failure stop them all."""
    procs = []
    try:
        for k, (role, args) in enumerate(specs):
            port = free_port()
            log = (log_dir / f"{role}-{k}-{port}.log") if log_dir else None
            procs.append(EmulatorProcess(role, port, args, log_path=log).start())
        for p in procs:
            p.wait_ready(timeout_s)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs
