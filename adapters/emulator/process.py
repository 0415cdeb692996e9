"""Start emulator processes, wait until they answer /health, stop them by PID.

Used by tests, benchmarks and `sibyl-console up`. The child is `python -m adapters.emulator`
(the same Typer command as `sibyl-console emulate`, without needing the console script), in a
session of its own so `stop()`/`kill()` reach exactly it and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from adapters.errors import BackendError
from adapters.orphans import guarded
from adapters.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


class EmulatorStartError(BackendError):
    """An emulator process exited or did not become healthy in time."""


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive free ports (for --instances n)."""
    for _ in range(50):
        base = free_port(host)
        if base + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for k in range(n):
                    s = stack.enter_context(socket.socket())
                    s.bind((host, base + k))
            return base
        except OSError:
            continue
    raise EmulatorStartError(f"found no {n} consecutive free ports on {host}")


@dataclass
class EmulatorProcess:
    """One `emulate` process (with `--instances N` in args it serves ports port … port+N-1)."""

    role: str
    port: int
    args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for the child beyond this process's own (e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def instances(self) -> int:
        if "--instances" in self.args:
            return int(self.args[self.args.index("--instances") + 1])
        return 1

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{self.port + i}" for i in range(self.instances)]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> EmulatorProcess:
        """Launch it; it stops by itself if this process dies (adapters.parent_watch)."""
        cmd = guarded(
            [
                sys.executable,
                "-m",
                "adapters.emulator",
                "--role",
                self.role,
                "--port",
                str(self.port),
                "--host",
                self.host,
                *self.args,
            ]
        )
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Poll /health of every instance until 200; fail fast if the process exits."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        pause = 0.01
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise EmulatorStartError(
                        f"emulator {self.role} on port {self.port} exited with {self.proc.returncode}{self._log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    while pending and client.get(pending[0] + "/health").status_code == 200:
                        pending.pop(0)
                if not pending:
                    return
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        raise EmulatorStartError(
            f"emulator {self.role} on port {self.port} not healthy after {timeout_s:.0f} s{self._log_tail()}"
        )

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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (graceful), then SIGKILL after `grace_s`."""
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

    def admin(
        self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None, instance: int = 0
    ) -> Any:
        """Call an /admin/ endpoint (e.g. `admin("PUT", "faults", {"slowdown": 2})`); returns the JSON."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.request(method, f"{self.urls[instance]}/admin/{path}", json=body, headers=headers, timeout=5.0)
        r.raise_for_status()
        return r.json()


def start_many(
    specs: list[tuple[str, list[str]]], log_dir: Path | None = None, timeout_s: float = 30.0
) -> list[EmulatorProcess]:
    """Start every (role, extra args) on free ports, wait for all; on failure stop them all."""
    procs: list[EmulatorProcess] = []
    try:
        for k, (role, args) in enumerate(specs):
            n = int(args[args.index("--instances") + 1]) if "--instances" in args else 1
            port = free_ports(n) if n > 1 else free_port()
            log = (log_dir / f"{role}-{k}-{port}.log") if log_dir else None
            procs.append(EmulatorProcess(role, port, args, log_path=log).start())
        for p in procs:
            p.wait_ready(timeout_s)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@contextlib.contextmanager
def running(
    *specs: tuple[str, list[str]], log_dir: Path | None = None, timeout_s: float = 30.0
) -> Iterator[list[EmulatorProcess]]:
    """`start_many` as a context manager that always stops the processes."""
    procs = start_many(list(specs), log_dir, timeout_s)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()
