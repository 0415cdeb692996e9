"""No orphans: launch children that die with the console, and find those a dead console left behind.

Every process a backend launches is started through adapters.parent_watch (the kernel stops it
when the console dies) and written to `<run dir>/pids/<instance>.json` with its start time, so a
console started after a crash can stop what an earlier one left running on hosts where the
parent-death signal is not available, or for a process that survived it. Attached instances are
never written there: the console never stops what it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from adapters.pids import running, stop_group


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` wrapped so that it receives SIGTERM when this process dies."""
    return [sys.executable, "-m", "adapters.parent_watch", str(os.getpid()), "--", *cmd]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def record(run_dir: Path, instance_id: str, pid: int) -> None:
    """Write the pid file of a launched instance."""
    folder = run_dir / "pids"
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "instance": instance_id,
        "pid": pid,
        "start_time": start_time(pid),
        "console_pid": os.getpid(),
        "recorded_at": time.time(),
    }
    (folder / f"{instance_id}.json").write_text(json.dumps(data))


def forget(run_dir: Path, instance_id: str) -> None:
    """The instance was stopped on purpose: its pid file goes."""
    with contextlib.suppress(OSError):
        (run_dir / "pids" / f"{instance_id}.json").unlink()


@dataclass
class Leftover:
    """A process a dead console launched that is still running."""

    run_id: str
    instance: str
    pid: int
    stopped: bool


def reap(runs_dir: Path, grace_s: float = 10.0) -> list[Leftover]:
    """Stop the still-running instances of every run whose console is gone (by process group,
    SIGTERM then SIGKILL). A pid that now belongs to another process (its start time differs)
    is left alone; pid files of live consoles are not touched."""
    found: list[Leftover] = []
    for path in sorted(runs_dir.glob("*/pids/*.json")) if runs_dir.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            pid, console = int(data["pid"]), int(data["console_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if running(console):
            continue  # its console still runs (this one, or another on this host)
        if data.get("start_time") is None or start_time(pid) != data["start_time"]:
            path.unlink(missing_ok=True)  # gone, or the pid was reused by something else
            continue
        found.append(
            Leftover(path.parent.parent.name, str(data.get("instance", path.stem)), pid, stop_group(pid, grace_s))
        )
        path.unlink(missing_ok=True)
    return found
