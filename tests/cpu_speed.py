"""How fast this machine's cores ran (CpuSpeedProbe, from a fixed loop's CPU time) and what the hypervisor stole.

On a shared VM a vCPU can run at half speed without any stolen time (another guest on its
hyperthread sibling, the host's clock), and the two vCPUs need not run at the same speed: that
moves real vLLM's latencies between runs minutes apart. A thread times a fixed ~1 ms loop four
times a second in *CPU* time (`time.thread_time`, so waiting for a core does not count), on each
core in turn, and a window's median says how fast a core ran then. The load it adds is ~0.4% of
one core."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

PERIOD_S = 0.25
LOOP = 20_000
"""Iterations of the timed loop (~1 ms of CPU on this machine's cores)."""


def _timed_loop() -> float:
    start = time.thread_time()
    total = 0
    for i in range(LOOP):
        total += i * i
    return time.thread_time() - start


class CpuSpeedProbe:
    """Samples (monotonic time, core, CPU seconds of the fixed loop) while in its `with` block."""

    def __init__(self, period_s: float = PERIOD_S, cores: list[int] | None = None) -> None:
        self.period_s = period_s
        self.cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-speed-probe", daemon=True)

    def __enter__(self) -> CpuSpeedProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.period_s):
            core = self.cores[turn % len(self.cores)]
            turn += 1
            os.sched_setaffinity(0, {core})  # this thread only (Linux)
            self.samples.append((time.monotonic(), core, _timed_loop()))

    def loop_s(self, start: float, end: float, core: int | None = None) -> float | None:
        """Median CPU seconds of the loop between two monotonic times, on one core or any (None:
        no sample then)."""
        inside = [s for t, c, s in list(self.samples) if start <= t <= end and core in (None, c)]
        return statistics.median(inside) if inside else None


def relative_speed(
    probe: CpuSpeedProbe, window: tuple[float, float], reference: list[tuple[float, float]], core: int | None = None
) -> float | None:
    """How fast a core (or the cores) ran in `window` relative to the `reference` windows (1.0: as
    fast; 0.5: half as fast), from the loop's median CPU time in each."""
    here = probe.loop_s(*window, core=core)
    there = [v for w in reference if (v := probe.loop_s(*w, core=core)) is not None]
    if here is None or not there:
        return None
    return statistics.median(there) / here


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat's first line: user ... steal)."""
    return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor gave to other guests between two samples."""
    delta = [a - b for a, b in zip(after, before, strict=True)]
    return delta[7] / sum(delta) if sum(delta) else 0.0
