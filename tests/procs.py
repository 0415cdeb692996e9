"""Helpers for end-to-end tests: start emulator and console processes on free ports, wait, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adapters.emulator.process import EmulatorProcess
from adapters.pids import running
from adapters.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
FIXED_PROFILE = str(ROOT / "tests" / "data" / "cpu-fixed.json")
"""A profile that stays put (cpu-tiny-llama's hand-measured values before calibration replaced
them): end-to-end tests whose thresholds, stream lengths and waits are set in its terms, so
that refreshing the shipped calibration does not move them."""
FAST_PROFILE = str(ROOT / "tests" / "data" / "cpu-fast.json")
"""A quick emulated engine (~10x quicker steps than FIXED_PROFILE) for end-to-end tests that check
what happens rather than when: replays of long trace outputs, API fuzzing."""


def alive(pid: int) -> bool:
    """The process runs (it exists and is not a zombie nobody has reaped yet)."""
    return running(pid)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` (HTTP errors count as False) until true or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def emulators(*specs: tuple[str, list[str]], log_dir: Path | None = None) -> Iterator[list[EmulatorProcess]]:
    procs = []
    try:
        for k, (role, args) in enumerate(specs):
            port = free_port()
            procs.append(
                EmulatorProcess(role, port, args, log_path=(log_dir / f"{role}{k}.log") if log_dir else None).start()
            )
        for p in procs:
            p.wait_ready(30)
        yield procs
    finally:
        for p in procs:
            p.stop()


@dataclass
class Console:
    url: str
    home: Path
    db: Path
    proc: subprocess.Popen[bytes]
    log: Path
    run_id: str = ""
    token: str = ""

    @property
    def run_dir(self) -> Path:
        return self.home / "runs" / self.run_id

    def control(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10)

    def state(self) -> dict:  # type: ignore[type-arg]
        with self.control() as c:
            return c.get("/control/state").json()  # type: ignore[no-any-return]

    def env(self) -> dict[str, str]:
        return {**os.environ, "SIBYL_HOME": str(self.home), "SIBYL_DB": str(self.db)}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "console.cli", *args],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_console(tmp: Path, *args: str, timeout: float = 60) -> Console:
    """`sibyl-console up --headless` in a subprocess with its own data dir and DB."""
    home = tmp / "home"
    db = tmp / "runs.db"
    port = free_port()
    log = tmp / "console.log"
    env = {**os.environ, "SIBYL_HOME": str(home), "SIBYL_DB": str(db)}
    cmd = [sys.executable, "-m", "console.cli", "up", "--headless", "--port", str(port), *args]
    out = open(log, "wb")  # noqa: SIM115 - the log stays open for the console's lifetime
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    console = Console(f"http://127.0.0.1:{port}", home, db, proc, log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"console exited with {proc.returncode}:\n{log.read_text()}")
        return (home / "console.json").exists() and httpx.get(console.url + "/health", timeout=1).status_code == 200

    try:
        wait_for(ready, timeout, "the console to serve")
        data = json.loads((home / "console.json").read_text())
        console.run_id = data["run_id"]
        console.token = Path(data["token_file"]).read_text().strip()
    except BaseException:
        console.stop(signal.SIGKILL)
        kill_children(home)
        raise
    return console


def kill_children(home: Path) -> None:
    """Emulators a SIGKILLed console could not stop: find them by their log folder and kill them."""
    out = subprocess.run(["pgrep", "-f", "adapters.emulator"], capture_output=True, text=True).stdout.split()
    for pid in map(int, out):
        with contextlib.suppress(OSError):
            cwd_env = Path(f"/proc/{pid}/environ").read_bytes()
            if str(home).encode() in cwd_env:
                os.kill(pid, signal.SIGKILL)


def decode_counts(console: Console) -> dict[str, float]:
    """Requests per decode instance, from the gateway's Prometheus counter."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(console.url + "/metrics").text):
        if fam.name == "sibyl_gateway_requests":
            for sample in fam.samples:
                if sample.name.endswith("_total"):
                    d = sample.labels["decode"]
                    out[d] = out.get(d, 0) + sample.value
    return out


def instance_steps_live(con: Console, iid: str) -> list[tuple[str, str]]:
    """Instance events from the console's own event stream history (before the run is flushed)."""
    with con.control() as c, c.stream("GET", "/control/events") as r:
        out = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "state":
                return out
            if ev["type"] == "instance" and ev["instance"] == iid:
                out.append((ev["event"], ev["detail"]))
    return out
