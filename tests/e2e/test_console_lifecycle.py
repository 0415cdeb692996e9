"""The console server outlives and ignores its dashboard: frozen, closed or quit terminals, on real ptys.

Each test runs `sibyl-console up` (the dashboard) in a real pseudo-terminal with emulated instance
processes, and checks what the operator and the clients see: the gateway keeps answering while the
terminal stops reading; a closed terminal stops everything within the drain bound; "leave running"
keeps serving until `tui` reattaches and `down` stops it; SIGTERM stops a console whose dashboard is
frozen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from adapters.ports import free_port
from adapters.store import RunStore
from tests.procs import FIXED_PROFILE, ROOT, alive, kill_children, wait_for
from tests.ptys import Terminal

DRAIN_S = 3.0
STOP_BOUND_S = 2 * DRAIN_S + 20 + 5
"""The server's own watchdog bound (2 × drain + 20 s grace) plus a margin: nothing may outlive it."""


@dataclass
class Cluster:
    """A console started by `up` in a pty, and every process it made."""

    term: Terminal
    home: Path
    db: Path
    url: str = ""
    run_id: str = ""
    server_pid: int = 0
    token: str = ""
    instance_pids: list[int] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SIBYL_HOME": str(self.home), "SIBYL_DB": str(self.db)}

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "console.cli", *args],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def processes(self) -> list[int]:
        return [p for p in (self.term.proc.pid, self.server_pid, *self.instance_pids) if alive(p)]

    def run_status(self) -> str:
        store = RunStore(self.db)
        try:
            return store.get_run(self.run_id).status
        finally:
            store.close()


def _config(tmp: Path) -> Path:
    path = tmp / "console.toml"
    path.write_text(
        f'prefill = 1\ndecode = 1\nprofile = "{FIXED_PROFILE}"\ndrain_timeout_s = {DRAIN_S}\npolicy = "least_load"\n'
    )
    return path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    home, db = tmp_path / "home", tmp_path / "runs.db"
    env = {**os.environ, "SIBYL_HOME": str(home), "SIBYL_DB": str(db)}
    term = Terminal(
        [sys.executable, "-m", "console.cli", "up", str(_config(tmp_path)), "--port", str(free_port())],
        env=env,
        cwd=ROOT,
    )
    c = Cluster(term, home, db)
    try:
        wait_for(lambda: (home / "console.json").exists(), 60, "the console server to announce itself")
        data = json.loads((home / "console.json").read_text())
        c.url, c.run_id, c.server_pid = data["url"], data["run_id"], int(data["pid"])
        c.token = Path(data["token_file"]).read_text().strip()
        c.instance_pids = [
            int(json.loads(p.read_text())["pid"]) for p in (home / "runs" / c.run_id / "pids").glob("*.json")
        ]
        assert len(c.instance_pids) == 2, c.instance_pids
        term.wait_for_text("instances", 30)  # the dashboard drew its first frame
        term.wait_for_text("d0", 30)  # and the state it polled from the server
        yield c
    finally:
        term.kill()
        for pid in (c.server_pid, *c.instance_pids):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
        kill_children(home)


class Traffic:
    """Clients that keep sending small completions and health checks until stopped; every answer counted."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        body = {"model": "sibyl-model", "prompt": [7] * 32, "max_tokens": 8, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self._stop.is_set():
                try:
                    r = client.post("/v1/completions", json=body)
                    h = client.get("/health")
                except httpx.HTTPError as e:
                    self.failures.append(f"{time.strftime('%X')} {type(e).__name__}: {e}")
                    continue
                if r.status_code == 200 and h.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8:
                    self.ok += 1
                else:
                    self.failures.append(f"{time.strftime('%X')} {r.status_code} {h.status_code} {r.text[:200]}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


def _wait_gone(pids: list[int], timeout: float, what: str) -> float:
    start = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in pids), timeout, what)
    return time.monotonic() - start


# The default suite keeps test_leave_running_then_reattach_then_down (up, leave running, reattach, down) as
# this file's check; a closed terminal stopping everything is also in tests/adapters/test_orphans.py.
@pytest.mark.slow  # a dashboard start and a 10 s frozen span: ~17 s (make test-slow)
@pytest.mark.parametrize("frozen_s", [pytest.param(10, id="10s"), pytest.param(60, id="60s")])
def test_a_terminal_that_stops_reading_never_stalls_the_gateway(cluster: Cluster, frozen_s: float) -> None:
    cluster.term.freeze()
    traffic = Traffic(cluster.url)
    try:
        time.sleep(frozen_s)  # the measured span: clients send as fast as they are answered
    finally:
        traffic.stop()
    backed_up = cluster.term.pending()
    assert traffic.failures == [], traffic.failures[:5]
    assert traffic.ok >= frozen_s, f"only {traffic.ok} answers in {frozen_s} s"
    assert backed_up >= 1024, f"the terminal did not back up ({backed_up} bytes unread): the test froze nothing"
    cluster.term.thaw()  # the dashboard catches up and still works
    cluster.term.type("?")
    cluster.term.wait_for_text("escape closes", 30, start=len(cluster.term.text()) - 200_000)


@pytest.mark.slow  # a dashboard start per test: ~14 s (make test-slow)
def test_a_closed_terminal_stops_everything_within_the_drain_bound(cluster: Cluster) -> None:
    pids = cluster.processes()
    assert len(pids) == 4  # the dashboard, the server, two emulated instances
    traffic = Traffic(cluster.url, clients=1)
    time.sleep(1)
    cluster.term.close()  # the hang-up a killed tmux session or terminal window gives
    took = _wait_gone(pids, STOP_BOUND_S, "every process to stop after the terminal closed")
    traffic.stop()
    assert took < STOP_BOUND_S
    assert cluster.run_status() == "completed"


@pytest.mark.slow  # ~5-15 s: the default suite stays under 6 min on 2 cores; make test-slow runs it
def test_leave_running_then_reattach_then_down(cluster: Cluster) -> None:
    cluster.term.type("q")
    cluster.term.wait_for_text("Leave running", 15)
    cluster.term.type("l")
    cluster.term.proc.wait(30)
    assert cluster.term.proc.returncode == 0
    cluster.term.wait_for_text("sibyl-console down", 5)
    # the cluster serves on with no dashboard anywhere
    traffic = Traffic(cluster.url, clients=1)
    time.sleep(2)
    traffic.stop()
    assert traffic.failures == [] and traffic.ok > 0
    assert alive(cluster.server_pid) and all(alive(p) for p in cluster.instance_pids)
    # reattach by run id, see the instances, quit (an attached dashboard leaves the cluster alone)
    tui = Terminal([sys.executable, "-m", "console.cli", "tui", "--run", cluster.run_id], env=cluster.env(), cwd=ROOT)
    try:
        tui.wait_for_text("d0", 30)
        tui.type("q")
        tui.proc.wait(30)
    finally:
        tui.kill()
    assert alive(cluster.server_pid)
    down = cluster.cli("down", cluster.run_id)
    assert down.returncode == 0, down.stderr
    assert f"stopped run {cluster.run_id} (completed)" in down.stderr
    assert not any(alive(p) for p in (cluster.server_pid, *cluster.instance_pids))
    assert cluster.cli("down").returncode != 0  # nothing left to stop: a clear error
    assert not (cluster.home / "runs" / cluster.run_id / "console.pid").exists()


@pytest.mark.slow  # a dashboard start per test: ~13 s each (make test-slow)
@pytest.mark.parametrize("target", ["server", "dashboard"])
def test_sigterm_while_the_dashboard_is_frozen_stops_within_the_bound(cluster: Cluster, target: str) -> None:
    cluster.term.freeze()
    wait_for(lambda: cluster.term.pending() >= 1024, 30, "the frozen terminal to back up")
    pids = cluster.processes()
    os.kill(cluster.server_pid if target == "server" else cluster.term.proc.pid, signal.SIGTERM)
    server_and_instances = [p for p in pids if p != cluster.term.proc.pid]
    took = _wait_gone(
        server_and_instances, STOP_BOUND_S, f"the server and its instances to stop after SIGTERM to the {target}"
    )
    assert took < STOP_BOUND_S
    assert cluster.run_status() == "completed"
    cluster.term.thaw()  # once its terminal reads again, the dashboard sees its server gone and exits
    cluster.term.proc.wait(30)
