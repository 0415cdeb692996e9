"""Policy canaries from the dashboard against a real console over emulator processes: a kind that cannot be split and
a share past 50% are refused in the picker and start nothing; a canary started there is the console's (GET
/control/canary), the advisor panel shows its figures as the console read them, `x` stops it after a confirmation,
and a short canary's verdict is shown when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Input, OptionList, Select, Static

from adapters.emulator.process import EmulatorProcess
from console.live.config import ConsoleConfig
from console.serve import LiveConsole
from console.tui.advisor import AdvisorPanel
from console.tui.app import SibylDashboard
from console.tui.canary_form import CanaryForm
from console.tui.client import DashboardClient
from console.tui.confirm import ConfirmScreen
from console.tui.instances import InstanceTable
from console.tui.policy_picker import PolicyPicker
from tests.console.tui.fakes import until
from tests.console.tui.live import serve_while


def text_of(panel: AdvisorPanel) -> str:
    """What the panel shows, as plain text."""
    out = Console(width=156, file=io.StringIO(), record=True)
    out.print(panel.render())
    return out.export_text()


def plain(widget: Static) -> str:
    return str(widget.render())


async def traffic(url: str, stop: asyncio.Event) -> None:
    """Short streamed completions (streamed: their TPOT is measured), four at a time, until `stop` is set."""
    body = {"model": "sibyl-model", "prompt": [1] * 64, "max_tokens": 6, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def worker() -> None:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass

        await asyncio.gather(*(worker() for _ in range(4)))


async def open_canary_picker(app: SibylDashboard, pilot: Pilot[Any]) -> PolicyPicker:
    """`c`: the picker on the routing kind with `canary` chosen."""
    await pilot.press("c")
    await until(pilot, lambda: isinstance(app.screen, PolicyPicker) and app.screen.policy is not None)
    picker = app.screen
    assert isinstance(picker, PolicyPicker) and picker.canary_chosen and picker.kind == "routing"
    form = picker.query_one(CanaryForm)
    assert form.texts() == ("10%", "5m")  # the CLI's defaults
    return picker


async def choose(picker: PolicyPicker, pilot: Pilot[Any], name: str) -> None:
    options = picker.query_one("#picker-policies", OptionList)
    options.highlighted = options.get_option_index(name)
    await until(pilot, lambda: picker.policy is not None and picker.policy["name"] == name)


@pytest.mark.slow  # ~23 s of a live canary: make test-slow runs it
def test_a_canary_from_the_picker_shown_and_stopped(
    tmp_path: Path, sibyl_home: Path, emulators: list[EmulatorProcess]
) -> None:
    p0, d0, d1 = emulators
    config = ConsoleConfig(
        attach={"prefill": [p0.url], "decode": [d0.url, d1.url]},
        port=0,
        db=tmp_path / "runs.db",
        headless=True,
        poll_interval_s=0.2,
        drain_timeout_s=0.5,
        policy="sibyl",
    )

    async def ui(live: LiveConsole) -> None:
        client = DashboardClient(live.url, live.token_file.read_text().strip())
        app = SibylDashboard(client, poll_interval_s=0.2)
        stop = asyncio.Event()
        load: asyncio.Task[None] | None = None
        try:
            async with app.run_test(size=(160, 48)) as pilot:
                await until(pilot, lambda: app.query_one(InstanceTable).row_count == 3)
                panel = app.query_one(AdvisorPanel)
                assert not panel.display  # no advisor configured, no canary yet
                assert app.check_action("stop_canary", ()) is False

                # a kind that cannot be split: the console's reason, and Apply starts nothing
                picker = await open_canary_picker(app, pilot)
                picker.query_one("#picker-kind", Select).value = "queue"
                note = picker.query_one("#canary-note", Static)
                await until(pilot, lambda: "a queue policy cannot be canaried" in plain(note))
                await pilot.press("ctrl+s")
                error = picker.query_one("#picker-error", Static)
                await until(pilot, lambda: plain(error).startswith("a queue policy cannot be canaried"))

                # back on routing: a share past 50% is refused under its field, and nothing starts
                picker.query_one("#picker-kind", Select).value = "routing"
                await until(pilot, lambda: picker.kind == "routing" and plain(note) == "")
                await choose(picker, pilot, "least_load")
                picker.query_one("#canary-share", Input).value = "60%"
                picker.query_one("#canary-for", Input).value = "1m"
                await pilot.press("ctrl+s")
                share_error = picker.query_one("#canary-share-error", Static)
                await until(pilot, lambda: "must be above 0 and at most 50%" in plain(share_error))
                assert "no canary was started" in plain(error)
                assert await client.canary() == {"running": None, "last": None}

                # 50% for a minute: started through POST /control/canary, source tui
                picker.query_one("#canary-share", Input).value = "50%"
                load = asyncio.create_task(traffic(live.url, stop))
                await pilot.press("ctrl+s")
                await until(pilot, lambda: not isinstance(app.screen, PolicyPicker))
                running = (await client.canary())["running"]
                assert running is not None and running["source"] == "tui"
                plan = running["plan"]
                assert (plan["kind"], plan["name"], plan["share"], plan["duration_s"]) == (
                    "routing",
                    "least_load",
                    0.5,
                    60.0,
                )
                cid = running["id"]
                await until(pilot, lambda: panel.display and f"canary {cid}: routing least_load" in text_of(panel))
                assert "on 50%" in text_of(panel) and "left of 1m00s" in text_of(panel)
                await until(pilot, lambda: app.check_action("stop_canary", ()) is True)

                # a second canary while this one runs: the console's 409, shown in the picker
                picker = await open_canary_picker(app, pilot)
                await pilot.press("ctrl+s")
                error = picker.query_one("#picker-error", Static)
                await until(pilot, lambda: "the console refused (409)" in plain(error), 15)
                assert f"canary {cid} (routing least_load on pool sibyl-model) is running" in plain(error)
                await pilot.press("escape")
                await until(pilot, lambda: not isinstance(app.screen, PolicyPicker))

                # both arms finish requests; then the traffic stops, so every later reading reads the same rows
                await until(pilot, lambda: min(_finished(app).values()) >= 5, 20)
                stop.set()
                await load
                reading = await _reading_with_figures(client, pilot)  # within 10 s: one reading every 10 s
                await until(pilot, lambda: _shown_reading(app) == reading["readings"], 15)
                shown = text_of(panel)
                finished = reading["finished"]
                assert f"requests finished: {finished['canary']} canary, {finished['control']} control" in shown
                figures = {f["figure"]: f for f in reading["reading"]["figures"]}
                assert {"attainment", "ttft_p99", "tpot_p99"} <= set(figures)
                att, ttft = figures["attainment"], figures["ttft_p99"]
                row = next(line for line in shown.splitlines() if line.strip().startswith("attainment"))
                assert f"{att['canary']:.1%}" in row and f"{att['control']:.1%}" in row
                assert f"[{att['low']:+.1%}, {att['high']:+.1%}]" in row and att["direction"] in row
                row = next(line for line in shown.splitlines() if line.strip().startswith("P99 TTFT"))
                assert f"{ttft['canary'] * 1000:.0f} ms" in row and f"{ttft['control'] * 1000:.0f} ms" in row
                assert f"{ttft['difference']:+.1%}" in row
                assert "interval" in shown and "P99 TPOT" in shown

                # x asks first: keeping it running changes nothing; confirming ends it interrupted
                await pilot.press("x")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
                await pilot.press("escape")
                await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
                assert (await client.canary())["running"] is not None
                await pilot.press("x")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
                await pilot.press("y")
                await until(pilot, lambda: (app.state and (app.state.canary or {}).get("running")) is None, 10)
                after = await client.canary()
                assert after["running"] is None and after["last"]["id"] == cid
                assert after["last"]["decision"] == "interrupted"
                assert after["last"]["reason"] == "stopped by the operator (tui)"
                assert (await client.state()).policy_entries()["routing"]["name"] == "sibyl"  # the active one stays
                ended = f"canary {cid} ended: interrupted — stopped by the operator (tui)"
                await until(pilot, lambda: ended in text_of(panel))
                assert app.check_action("stop_canary", ()) is False

                # a short canary with no traffic: its verdict when it ends
                picker = await open_canary_picker(app, pilot)
                picker.query_one("#canary-for", Input).value = "3s"
                await pilot.press("ctrl+s")
                await until(pilot, lambda: not isinstance(app.screen, PolicyPicker))
                await until(pilot, lambda: _last(app).get("id") not in (None, cid), 15)
                last = (await client.canary())["last"]
                assert last["decision"] == "inconclusive" and last["plan"]["share"] == 0.1
                await until(pilot, lambda: f"canary {last['id']}" in text_of(panel))
                shown = text_of(panel)
                assert f"canary {last['id']} ended: inconclusive — too few requests: 0 canary, 0 control" in shown
        finally:
            stop.set()
            if load is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await load
            await client.aclose()

    serve_while(config, ui)


def _canary(app: SibylDashboard) -> dict[str, Any]:
    return (app.state.canary if app.state is not None else None) or {}


def _finished(app: SibylDashboard) -> dict[str, int]:
    running = _canary(app).get("running") or {}
    return dict(running.get("finished") or {"canary": 0, "control": 0})


def _shown_reading(app: SibylDashboard) -> int:
    """How many readings the panel's canary had when it was last shown."""
    panel = app.query_one(AdvisorPanel)
    return int(((panel.canary or {}).get("running") or {}).get("readings") or 0)


def _last(app: SibylDashboard) -> dict[str, Any]:
    return dict(_canary(app).get("last") or {})


async def _reading_with_figures(client: DashboardClient, pilot: Pilot[Any]) -> dict[str, Any]:
    """The running canary at its first reading taken after the traffic stopped (every later one reads the same rows)."""
    await pilot.pause(0.5)  # the last responses' rows reach the canary
    before = (await client.canary())["running"]
    assert before is not None, "the canary ended before its figures were read"
    for _ in range(150):
        running = (await client.canary())["running"]
        assert running is not None, "the canary ended before its figures were read"
        if running["readings"] > before["readings"]:
            assert running["reading"]["figures"], running["reading"]
            assert running["reading"]["canary_n"] == running["finished"]["canary"]
            return dict(running)
        await pilot.pause(0.2)
    raise AssertionError("no reading after the traffic stopped")
