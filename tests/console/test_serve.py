"""The console server process's own settings, read inside a console served in the test's process."""

from __future__ import annotations

import gc
from pathlib import Path

from console.live.config import ConsoleConfig
from console.serve import GC_YOUNG_THRESHOLD, LiveConsole
from tests.console.tui.live import serve_while


def test_a_serving_console_collects_young_garbage_less_often(tmp_path: Path, sibyl_home: Path) -> None:
    """Once serving, the collector's young threshold is the console's (its older ones Python's), so
    requests' short-lived objects die before a collection moves them into the generations whose
    collections walk all the console keeps."""
    before = gc.get_threshold()
    seen: list[tuple[int, ...]] = []

    async def ui(live: LiveConsole) -> None:
        seen.append(gc.get_threshold())

    try:
        gc.set_threshold(700, 10, 10)
        serve_while(ConsoleConfig(backend="sim", port=0, db=tmp_path / "runs.db"), ui)
    finally:
        gc.set_threshold(*before)
    assert seen == [(GC_YOUNG_THRESHOLD, 10, 10)]
    assert GC_YOUNG_THRESHOLD > 700
