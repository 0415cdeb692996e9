"""The dashboard against a real console with emulated vLLM instances: values, swap → SQLite, kill → DOWN."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
from textual.widgets import OptionList, Select

from adapters.emulator.process import EmulatorProcess
from adapters.store import RunStore
from console.live.config import ConsoleConfig
from console.serve import LiveConsole
from console.tui.app import SibylDashboard
from console.tui.client import DashboardClient
from console.tui.instances import InstanceTable
from console.tui.policy_picker import PolicyPicker
from tests.console.tui.fakes import until
from tests.console.tui.live import serve_while


async def _traffic(url: str, n: int) -> None:
    """A few long streaming completions so the decode instances have running requests."""
    body = {"model": "sibyl-model", "prompt": [1] * 64, "max_tokens": 100, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one() -> None:
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass

        await asyncio.gather(*(one() for _ in range(n)))


def test_dashboard_on_an_emulated_cluster(tmp_path: Path, sibyl_home: Path, emulators: list[EmulatorProcess]) -> None:
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
    seen: dict[str, str] = {}

    async def ui(live: LiveConsole) -> None:
        seen["run_id"] = live.run_id
        client = DashboardClient(live.url, live.token_file.read_text().strip())
        app = SibylDashboard(client, poll_interval_s=0.2)
        traffic = asyncio.create_task(_traffic(live.url, 6))
        try:
            async with app.run_test(size=(160, 48)) as pilot:
                table = app.query_one(InstanceTable)
                await until(pilot, lambda: table.row_count == 3)
                assert [str(r.key.value) for r in table.ordered_rows] == ["p0", "d0", "d1"]
                await until(pilot, lambda: sum(int(table.row_texts(d)["running"]) for d in ("d0", "d1")) > 0)
                assert all(table.row_texts(i)["health"] == "UP" for i in ("p0", "d0", "d1"))
                traffic.cancel()  # Pilot waits for an idle process after each key: keep the rest quiet

                await pilot.press("p")
                await until(pilot, lambda: isinstance(app.screen, PolicyPicker) and app.screen.policy is not None)
                picker = app.screen
                assert isinstance(picker, PolicyPicker)
                # the keyboard path through the picker is covered in test_tui.py; here each key
                # costs up to 2 s because Pilot waits for an idle process that also runs the console
                options = picker.query_one("#picker-policies", OptionList)
                options.highlighted = options.get_option_index("least_load")
                await until(pilot, lambda: picker.policy is not None and picker.policy["name"] == "least_load")
                await until(pilot, lambda: picker.query_one("#param-by", Select).value == "requests")
                picker.query_one("#param-by", Select).value = "tokens"
                await pilot.press("ctrl+s")
                await until(pilot, lambda: not isinstance(app.screen, PolicyPicker))
                state = await client.state()  # checked through the control API, not the app
                assert state.policy_entries()["routing"] == {
                    "name": "least_load",
                    "params": {"by": "tokens", "bind": "arrival"},
                }

                d1.kill()
                await until(pilot, lambda: table.row_texts("d1")["health"] == "DOWN")
                assert table.row_texts("d0")["health"] == "UP"
        finally:
            traffic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await traffic
            await client.aclose()

    serve_while(config, ui)
    store = RunStore(tmp_path / "runs.db")
    events = store.policy_events(seen["run_id"])
    store.close()
    swaps = [e for e in events if e["source"] == "tui"]
    assert len(swaps) == 1
    assert swaps[0]["kind"] == "routing" and swaps[0]["old"] == "sibyl" and swaps[0]["new"] == "least_load"
    assert swaps[0]["params"] == {"by": "tokens", "bind": "arrival"}


def test_dashboard_pauses_a_replay_and_scales_a_real_cluster(tmp_path: Path, sibyl_home: Path) -> None:
    demo = Path(__file__).resolve().parents[3] / "demos" / "azure_conv_sample.csv"
    config = ConsoleConfig(
        prefill=1,
        decode=1,
        profile="cpu-tiny-llama",
        port=0,
        db=tmp_path / "runs.db",
        headless=True,
        poll_interval_s=0.2,
        drain_timeout_s=0.5,
        replay=demo,
        replay_speed=2.0,
        replay_loop=True,
    )

    async def ui(live: LiveConsole) -> None:
        client = DashboardClient(live.url, live.token_file.read_text().strip())
        app = SibylDashboard(client, poll_interval_s=0.2)
        try:
            async with app.run_test(size=(160, 48)) as pilot:
                await until(pilot, lambda: {"scale", "replay"} <= set(app.capabilities), 15)
                await pilot.press("space")
                await until(
                    pilot,
                    lambda: (
                        app.state is not None and app.state.replay is not None and app.state.replay.status == "paused"
                    ),
                    10,
                )
                replay = (await client.state()).replay
                assert replay is not None and replay.status == "paused"
                await pilot.press("space")
                await until(
                    pilot,
                    lambda: (
                        app.state is not None and app.state.replay is not None and app.state.replay.status == "running"
                    ),
                    10,
                )
                await pilot.press("plus")
                await until(
                    pilot,
                    lambda: app.state is not None and len([i for i in app.state.instances if i.role == "decode"]) == 2,
                    30,
                )
                state = await client.state()
                assert [i.id for i in state.instances if i.role == "decode"] == ["d0", "d1"]
        finally:
            await client.aclose()

    serve_while(config, ui)
