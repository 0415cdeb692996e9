"""Re-pinning a launched CPU instance's threads: core lists, process groups, affinities of a real process group."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adapters.pids import group_pids
from adapters.vllm.affinity import parse_cores, pin_process_group
from tests.procs import wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity calls")

THREADS = (
    "import threading, time; "
    "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]; time.sleep(60)"
)


def test_core_lists_in_vllms_format() -> None:
    assert parse_cores("0") == {0}
    assert parse_cores("0-3") == {0, 1, 2, 3}
    assert parse_cores("5,2-4") == {2, 3, 4, 5}
    for bad in ("", "a", "1-b", ","):
        with pytest.raises(ValueError, match="core list"):
            parse_cores(bad)


def test_every_thread_of_every_process_in_the_group_is_pinned() -> None:
    """A group leader with a child, each with extra threads, starts on every core and ends on one."""
    core = max(os.sched_getaffinity(0))
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {THREADS!r}]); {THREADS}",
        ],
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                len(group_pids(leader.pid)) == 2
                and all(len(os.listdir(f"/proc/{p}/task")) >= 4 for p in group_pids(leader.pid))
            ),
            30,
            "the group's two processes and their threads",
        )
        pids = group_pids(leader.pid)
        assert os.getpid() not in pids and leader.pid in pids
        pinned = pin_process_group(leader.pid, {core})
        assert pinned >= 8
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {core}
        assert os.sched_getaffinity(0) != {core} or len(os.sched_getaffinity(0)) == 1  # this process is untouched
    finally:
        os.killpg(leader.pid, 9)
        leader.wait(10)
