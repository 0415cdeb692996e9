"""Processes by id: whether one runs, and stopping a whole process group (TERM, then KILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """Whether the pid exists (a zombie counts; another user's process counts)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int) -> bool:
    """Whether the pid exists and is not a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return pid_alive(pid) if not Path("/proc").is_dir() else False
    return stat[stat.rfind(")") + 2] != "Z"


def group_pids(pgid: int) -> list[int]:
    """The non-zombie processes of process group `pgid`, from /proc (empty where there is none)."""
    pids: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return pids
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group `pgid`."""
    if Path("/proc").is_dir():
        return bool(group_pids(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float, reap: Callable[[], object] | None = None) -> bool:
    """SIGTERM process group `pgid`, wait up to `grace_s` for all of it to go, then SIGKILL what
    is left. `reap` (e.g. Popen.poll of our own child) is called while waiting so the leader
    does not linger as a zombie. False when the group is not ours to signal."""
    if reap is not None:
        reap()
    if not group_alive(pgid):
        return True
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return True
