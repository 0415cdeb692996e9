"""A host's streaming board: the tokens per second each emulated instance on one host streams now.

On a host whose cores the engines and the gateway share, every token streamed to a client costs
host work (the gateway's, the decode instance's API server's), and a prefill step run meanwhile
takes longer: `PerfProfile.host_stretch` of what the whole host streams (core/calibration/host.py
fits its cost per token from real runs). Emulated instances run as separate processes, so they
share what they stream through a small memory-mapped file: after every step an instance writes to
its slot the tokens that step streamed to clients over its length, with the step's start and end
(on CLOCK_MONOTONIC, which every process on the host shares), and a prefill step reads the sum of
the rates still current: a rate holds until one more step of its length has passed, so an
instance that idles stops counting without writing. The `emulator` backend gives its instances one
board in the run folder and a free slot each; an instance started without one streams for nobody
and reads nothing (no stretch).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from adapters.emulator.engine import Engine
    from adapters.emulator.sequence import Scheduler, Sequence, StepRecord

SLOTS = 1024
"""Instances one board holds."""
FIELDS = 3
"""Per slot: tokens per second, and the start and end of the step that streamed them."""
SLACK_S = 0.002
"""How late past one more step a rate still holds (the next step's start is a little late)."""


class HostBoard:
    """The board file, mapped: `publish` one instance's rate, `total` the host's current ones."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SLOTS * FIELDS * 8:
                os.ftruncate(fd, SLOTS * FIELDS * 8)  # zero-filled: nothing streams yet
            self._map = mmap.mmap(fd, SLOTS * FIELDS * 8)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=np.float64, count=SLOTS * FIELDS).reshape(SLOTS, FIELDS)

    def publish(self, slot: int, tokens_per_s: float, start: float = 0.0, end: float = 0.0) -> None:
        """What the instance in `slot` streamed over its step from `start` to `end` (0: nothing)."""
        row = self._slots[slot % SLOTS]
        row[0] = 0.0  # a reader between these writes sees nothing rather than a rate with another step's times
        row[1], row[2] = start, end
        row[0] = tokens_per_s

    def total(self) -> float:
        """What the host's instances stream now, together: the rates whose step ended less than one
        more step (and SLACK_S) ago."""
        rate, start, end = self._slots[:, 0], self._slots[:, 1], self._slots[:, 2]
        current = self.clock() - end <= end - start + SLACK_S
        return float(np.sum(rate, where=current & (rate > 0)))

    def close(self) -> None:
        del self._slots
        self._map.close()


class InstanceStreaming:
    """One instance's place on the board: its steps' streamed tokens (`on_step`, a data-parallel
    group's steps as one) and the host's total for its prefill steps."""

    def __init__(self, board: HostBoard, slot: int) -> None:
        self.board = board
        self.slot = slot

    def on_step(self, record: StepRecord, sampled: Seq[Sequence]) -> None:
        """A step ended: the tokens it streamed to clients (prefill legs' tokens stay on the host)."""
        streamed = sum(1 for s in sampled if s.sink is not None and not s.prefill_only)
        length = record.end - record.start
        self.board.publish(self.slot, streamed / length if length > 0 else 0.0, record.start, record.end)

    def attach(self, scheduler: Scheduler, engines: list[Engine]) -> None:
        """Hear every step of the instance's `scheduler` (after the hook it has) and give its `engines`
        the host's total."""
        before = scheduler.on_step

        def on_step(record: StepRecord, sampled: list[Sequence]) -> None:
            if before is not None:
                before(record, sampled)
            self.on_step(record, sampled)

        scheduler.on_step = on_step
        for engine in engines:
            engine.host_streaming = self.board.total

    def stop(self) -> None:
        """It streams nothing any more: its slot says so, and the board is unmapped."""
        self.board.publish(self.slot, 0.0)
        self.board.close()
