"""Fixtures shared by the test tree (tests/core, tests/adapters, tests/console, tests/e2e, tests/slow)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def sibyl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory of this test's own (SIBYL_HOME): no console of another test, or of the
    machine, is announced in it, and what the test's consoles announce stays there."""
    home = tmp_path / "home"
    monkeypatch.setenv("SIBYL_HOME", str(home))
    return home
