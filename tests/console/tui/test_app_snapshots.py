"""Snapshot tests of the dashboard layout at 160x48 with deterministic data (pytest-textual-snapshot)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from console.tui.app import SibylDashboard
from console.tui.messages import ConsoleEvent, StateArrived
from console.tui.policy_picker import PolicyPicker
from tests.console.tui.fakes import FakeConsole

SIZE = (160, 48)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Event-log times are local; pin the zone so snapshots match anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def scripted(prefill: int = 2, decode: int = 4, theme: str = "textual-dark") -> tuple[SibylDashboard, Any]:
    """An app fed 60 snapshots (30 s), a policy swap at 12 s and an instance failure at 20 s."""
    clock = {"t": 0.0}
    fake = FakeConsole(prefill, decode, clock=lambda: clock["t"])
    app = SibylDashboard(fake.client(), autopoll=False)

    async def run_before(pilot: Pilot[None]) -> None:
        app.theme = theme
        app.events_live = True  # the script below plays the event stream
        seen = 0
        for i in range(60):
            clock["t"] = i * 0.5
            if i == 24:
                fake.policies["routing"] = {"name": "least_load", "params": {"by": "tokens"}}
                fake.publish(
                    "policy",
                    kind="routing",
                    old="sibyl",
                    new="least_load",
                    params={"by": "tokens"},
                    source="tui",
                    t=clock["t"],
                )
            if i == 40:
                fake.set_health("d1", False)
                fake.publish("failure", request_id="cmpl-7", reason="decode d1 unreachable", prefill="p0", decode="d1")
            app.on_state_arrived(StateArrived(fake.snapshot()))
            for event in fake.history[seen:]:
                app.on_console_event(ConsoleEvent(event))
            seen = len(fake.history)
        await pilot.pause()

    return app, run_before


def test_dashboard_dark(snap_compare: Any) -> None:
    app, run_before = scripted()
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_dashboard_light_64_instances(snap_compare: Any) -> None:
    app, run_before = scripted(8, 56, theme="textual-light")
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_policy_picker(snap_compare: Any) -> None:
    app, feed = scripted()

    async def run_before(pilot: Pilot[None]) -> None:
        await feed(pilot)
        await pilot.press("p")
        while not (isinstance(app.screen, PolicyPicker) and app.screen.policy is not None):
            await pilot.pause(0.05)
        await pilot.press("home")
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
