"""Pin every thread of a launched CPU vLLM instance to its own cores, once it is up.

`VLLM_CPU_OMP_THREADS_BIND` pins only OpenMP threads, and vLLM 0.32's NIXL connector then moves
the worker's main thread (its OpenMP master, so its compute) to the last core of the NUMA node
(`base_worker.py`: `os.sched_setaffinity(0, rsv_cores_for_kv)`, meant for the KV-transfer thread).
On a host with one core per instance every instance's compute then shares the last core while the
others idle. Re-pinning the whole process group after start-up gives each instance the cores it
was planned (threads created later inherit their creator's mask).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from adapters.pids import group_pids

PROC = Path("/proc")


def parse_cores(spec: str) -> set[int]:
    """Cores from a list like "0", "0-3" or "5,2-4" (the `VLLM_CPU_OMP_THREADS_BIND` form)."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad core list {spec!r}: use numbers and ranges like 0-3,6")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError(f"empty core list {spec!r}")
    return cores


def pin_process_group(pgid: int, cores: set[int]) -> int:
    """Set the affinity of every thread of every process in the group; the number of threads pinned."""
    pinned = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
            for tid in tids:
                with contextlib.suppress(OSError):  # a thread may end meanwhile
                    os.sched_setaffinity(tid, cores)
                    pinned += 1
    return pinned
