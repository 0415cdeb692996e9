"""Fixtures of the dashboard tests: emulator processes for the live ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.emulator.process import EmulatorProcess, start_many


@pytest.fixture
def emulators(tmp_path: Path) -> Iterator[list[EmulatorProcess]]:
    """1 prefill + 2 decode emulator processes on free ports."""
    args = ["--profile", "h20-qwen3-32b"]
    procs = start_many([("prefill", args), ("decode", args), ("decode", args)], log_dir=tmp_path, timeout_s=60)
    yield procs
    for p in procs:
        p.stop()
