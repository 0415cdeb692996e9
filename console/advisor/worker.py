"""The advisor's worker process: windows in, advice out, at a low CPU priority, never on the caller's event loop.

The live server calls `submit(window)` every period and `latest()` whenever it wants the newest
answer; neither waits for a simulation. One window is simulated at a time: a window submitted while
one is running waits (a newer one replaces it), so a slow advisor skips periods instead of queueing
them. The child runs under `os.nice(NICE)` and reports its own CPU time (user + system, from
`resource.getrusage`) with every answer, so the console can show what the advisor costs. It keeps
the error history (what a gain must clear) across windows, and what its last advices cost, which
decides when it models the prefix cache in coarse blocks (`coarse`, the `[advisor] coarse_*` rule:
console/advisor/coarse.py).

    worker = AdvisorWorker(Shape(2, 4), profile)
    worker.submit(window)            # returns at once
    ...
    answer = worker.latest()         # None until the first answer; never blocks
    await worker.next_answer(30.0)   # or wait for one without blocking the loop
    worker.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import resource
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from console.advisor.coarse import CoarseChooser, CoarseRule
from console.advisor.simulate import Advice, Candidate, ErrorHistory, Shape, advise
from console.advisor.window import Window
from core.perf import PerfProfile
from core.sim.cluster import Mode

NICE = 10
"""How much the worker lowers its own priority: the data plane's process wins any contest for a core."""


@dataclass(frozen=True)
class Job:
    """One window to advise on, with the shape (and its instances' own profiles) and main profile in force
    when it was taken."""

    job: int
    window: Window
    shape: Shape
    profile: PerfProfile
    candidates: list[Candidate] | None
    mode: Mode
    seed: int
    coarse: CoarseRule = CoarseRule(blocks=1)
    """When to model the prefix cache in coarse blocks (console/advisor/coarse.py; default: never)."""


@dataclass(frozen=True)
class WorkerAnswer:
    """The worker's answer to one job: advice, or the error that stopped it."""

    job: int
    advice: Advice | None
    error: str | None
    cpu_s: float
    """The worker's CPU time (user + system) since it started."""
    job_cpu_s: float
    """CPU time this job took."""
    wall_s: float
    pid: int
    finished_at: float
    """time.time() when it finished."""

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "advice": None if self.advice is None else self.advice.to_json(),
            "error": self.error,
            "cpu_s": self.cpu_s,
            "job_cpu_s": self.job_cpu_s,
            "wall_s": self.wall_s,
            "pid": self.pid,
            "finished_at": self.finished_at,
        }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(conn: Connection, nice: int) -> None:
    """The child's loop: advise on each job received until told to stop (None) or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the console's Ctrl-C is the parent's to handle
    if nice:
        os.nice(nice)
    history = ErrorHistory()
    chooser: CoarseChooser | None = None
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        started, cpu0 = time.perf_counter(), time.process_time()
        advice, error = None, None
        if chooser is None or chooser.rule != job.coarse:
            chooser = CoarseChooser(job.coarse)
        has_keys = job.window.prefix_keys is not None
        key_blocks, why = chooser.choose(job.shape.n_prefill + job.shape.n_decode, has_keys)
        try:
            advice = advise(
                job.window,
                job.shape,
                job.profile,
                candidates=job.candidates,
                recent=history.recent(),
                mode=job.mode,
                seed=job.seed,
                key_blocks=key_blocks,
                cache_why=why,
            )
            history.add(advice.error)
            chooser.record(key_blocks, time.process_time() - cpu0, has_keys)
        except Exception as e:  # an answer, not a dead worker: the console shows it
            error = f"{type(e).__name__}: {e}"
        answer = WorkerAnswer(
            job=job.job,
            advice=advice,
            error=error,
            cpu_s=_cpu_s(),
            job_cpu_s=time.process_time() - cpu0,
            wall_s=time.perf_counter() - started,
            pid=os.getpid(),
            finished_at=time.time(),
        )
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


class AdvisorWorker:
    """A worker process that advises on windows; its methods return at once (see the module docstring)."""

    def __init__(
        self,
        shape: Shape,
        profile: PerfProfile,
        *,
        candidates: list[Candidate] | None = None,
        mode: Mode = "iteration",
        seed: int = 0,
        nice: int = NICE,
        coarse: CoarseRule | None = None,
    ) -> None:
        self.shape, self.profile = shape, profile
        self.candidates, self.mode, self.seed = candidates, mode, seed
        self.coarse = coarse or CoarseRule(blocks=1)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child, nice), name="sibyl-advisor", daemon=True)
        self._process.start()
        child.close()
        self.started_at = time.monotonic()
        self._jobs = 0
        self._running: int | None = None
        self._pending: tuple[int, Window] | None = None
        self._latest: WorkerAnswer | None = None
        self.skipped = 0
        """Windows replaced by a newer one before the worker was free to take them."""

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def configure(self, shape: Shape | None = None, profile: PerfProfile | None = None) -> None:
        """The live shape (with each instance's calibrated profile, `Shape.profiles`) or the main profile
        changed: later windows are simulated with these (both travel with each job; PerfProfile pickles)."""
        self.shape = shape or self.shape
        self.profile = profile or self.profile

    def submit(self, window: Window) -> int:
        """Hand the worker a window; returns its job number. While a window is being simulated the new one
        waits, replacing any that was already waiting."""
        self._collect()
        self._jobs += 1
        if self._running is None:
            self._send(self._jobs, window)
        else:
            if self._pending is not None:
                self.skipped += 1
            self._pending = (self._jobs, window)
        return self._jobs

    def latest(self) -> WorkerAnswer | None:
        """The newest answer so far (None before the first); never waits."""
        self._collect()
        return self._latest

    async def next_answer(self, timeout_s: float, interval_s: float = 0.05) -> WorkerAnswer | None:
        """Wait, without blocking the event loop, for an answer newer than the one `latest` gives now."""
        before = self._latest
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._collect()
            if self._latest is not before:
                return self._latest
            if not self.alive:
                break
            await asyncio.sleep(interval_s)
        return None

    def cpu_share(self) -> float | None:
        """The worker's CPU time as a share of one core since it started (from its latest answer)."""
        if self._latest is None:
            return None
        return self._latest.cpu_s / max(time.monotonic() - self.started_at, 1e-9)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker: asked first, terminated past `timeout_s`, killed past twice that."""
        with contextlib.suppress(OSError, BrokenPipeError, ValueError):
            self._conn.send(None)
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout_s)
        self._conn.close()

    def _send(self, number: int, window: Window) -> None:
        job = Job(number, window, self.shape, self.profile, self.candidates, self.mode, self.seed, self.coarse)
        self._conn.send(job)
        self._running = job.job

    def _collect(self) -> None:
        """Take every answer waiting in the pipe; start the window that waited, if any."""
        if self._conn.closed:
            return
        try:
            while self._conn.poll(0):
                answer: WorkerAnswer = self._conn.recv()
                self._latest = answer
                if answer.job == self._running:
                    self._running = None
        except (EOFError, OSError):
            self._running = None
            return
        if self._running is None and self._pending is not None:
            (number, window), self._pending = self._pending, None
            self._send(number, window)
