"""A host's streaming board: the tokens per second each emulated instance on one host streams now.

On a host whose cores the engines and the gateway share, every token streamed to a client costs
host work (the gateway's, the decode instance's API server's), and a prefill step run meanwhile
takes longer: `PerfProfile.host_stretch` of what the whole host streams (core/calibration/host.py
fits its cost per token from real runs). Emulated instances run as separate processes, so they
share what they stream through a small memory-mapped file: each instance writes its own rate to
its slot after every step (0 when it idles), and a prefill step reads the sum when it starts. The
`emulator` backend gives its instances one board in the run folder and a free slot each; an
instance started without one streams for nobody and reads nothing (no stretch).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

SLOTS = 1024
"""Instances one board holds (8 bytes each)."""


class HostBoard:
    """The board file, mapped: `publish` one instance's rate, `total` the host's."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SLOTS * 8:
                os.ftruncate(fd, SLOTS * 8)  # zero-filled: nothing streams yet
            self._map = mmap.mmap(fd, SLOTS * 8)
        finally:
            os.close(fd)
        self._rates = np.frombuffer(self._map, dtype=np.float64, count=SLOTS)

    def publish(self, slot: int, tokens_per_s: float) -> None:
        """What the instance in `slot` streams now."""
        self._rates[slot % SLOTS] = tokens_per_s

    def total(self) -> float:
        """What the host's instances stream now, together."""
        return float(self._rates.sum())

    def close(self) -> None:
        del self._rates
        self._map.close()


class InstanceStreaming:
    """One instance's share of the board: the sum of its engines' rates (a data-parallel group's
    ranks stream apart) in its slot."""

    def __init__(self, board: HostBoard, slot: int, engines: int) -> None:
        self.board = board
        self.slot = slot
        self._rates = [0.0] * engines

    def publish(self, engine: int, tokens_per_s: float) -> None:
        if self._rates[engine] != tokens_per_s:
            self._rates[engine] = tokens_per_s
            self.board.publish(self.slot, sum(self._rates))

    def host_total(self) -> float:
        return self.board.total()
