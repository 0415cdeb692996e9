"""No orphans: the instances a console launched stop when it stops, however it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from adapters import orphans
from adapters.store import RunStore
from tests.procs import FIXED_PROFILE, alive, kill_children, start_console, wait_for

ARGS = ["--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "2"]


def instance_pids(con: object) -> list[int]:
    return [i["pid"] for i in con.state()["instances"]]  # type: ignore[attr-defined]


def test_instances_stop_by_themselves_when_the_console_is_killed(tmp_path: Path) -> None:
    con = start_console(tmp_path, *ARGS)
    try:
        pids = instance_pids(con)
        assert len(pids) == 3 and all(alive(p) for p in pids)
        os.kill(con.proc.pid, signal.SIGKILL)  # no handler runs: only the kernel can tell them
        con.proc.wait(10)
        wait_for(lambda: not any(alive(p) for p in pids), 15, "the emulators to notice their console died")
    finally:
        con.stop()
        kill_children(con.home)


def test_a_closed_terminal_stops_the_console_and_its_instances_cleanly(tmp_path: Path) -> None:
    con = start_console(tmp_path, *ARGS)
    try:
        pids = instance_pids(con)
        os.kill(con.proc.pid, signal.SIGHUP)  # what an SSH session dropping or `tmux kill-session` sends
        assert con.proc.wait(30) == 0
        assert not any(alive(p) for p in pids)
        assert RunStore(con.db).get_run(con.run_id).status == "completed"
        assert not list((con.run_dir / "pids").glob("*.json"))  # stopped on purpose: no pid file left
    finally:
        con.stop()
        kill_children(con.home)


def test_a_new_console_stops_what_a_dead_one_left_running(tmp_path: Path) -> None:
    """Where the parent-death signal did not help (another OS, a process that ignored it), the
    pid files let the next console stop the leftovers; a reused pid is never touched."""
    runs = tmp_path / "runs"
    dead_console = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_console.wait()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        orphans.record(runs / "r-crashed", "d0", leftover.pid)
        orphans.record(runs / "r-crashed", "d1", unrelated.pid)
        for name in ("d0", "d1"):
            path = runs / "r-crashed" / "pids" / f"{name}.json"
            data = json.loads(path.read_text())
            data["console_pid"] = dead_console.pid
            if name == "d1":
                data["start_time"] = (data["start_time"] or 0) - 1  # the pid now names another process
            path.write_text(json.dumps(data))
        mine = runs / "r-live"
        orphans.record(mine, "d0", unrelated.pid)  # this console is alive: never reaped
        found = orphans.reap(runs, grace_s=5)
        assert [(f.run_id, f.instance, f.pid, f.stopped) for f in found] == [("r-crashed", "d0", leftover.pid, True)]
        assert leftover.wait(10) == -signal.SIGTERM
        assert unrelated.poll() is None
        assert not list((runs / "r-crashed" / "pids").glob("*.json")) and (mine / "pids" / "d0.json").exists()
    finally:
        for p in (leftover, unrelated):
            p.kill()
            p.wait()


def test_the_guard_refuses_to_start_a_child_whose_parent_is_already_gone() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "adapters.parent_watch", "1", "--", "true"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and "parent 1 is gone" in out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "adapters.parent_watch", str(os.getpid()), "--", sys.executable, "-c", "print('ran')"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "ran"
