"""Dashboard actions with Pilot on the fake API: quit, scale, replay, help, palette, sort, fallbacks."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console
from textual.command import CommandList
from textual.widgets import OptionList

from console.live.state import ConsoleState
from console.tui.charts import LoadChart, SloChart
from console.tui.events import EventLog
from console.tui.help import HelpScreen, QuitScreen, help_table
from console.tui.instances import InstanceTable
from console.tui.messages import StateArrived
from console.tui.policy_picker import PolicyPicker
from tests.console.tui.fakes import SIZE, FakeConsole, app_for, until


async def _quit_owned(fake: FakeConsole, key: str) -> str | None:
    """Quit a dashboard that owns its cluster: cancel once, then answer with `key`."""
    owned = app_for(fake, owns_cluster=True)
    async with owned.run_test(size=SIZE) as pilot:
        await pilot.press("q")
        await until(pilot, lambda: isinstance(owned.screen, QuitScreen))
        await pilot.press("escape")  # cancel: the dashboard stays
        await until(pilot, lambda: not isinstance(owned.screen, QuitScreen))
        assert owned.is_running
        await pilot.press("q")
        await until(pilot, lambda: isinstance(owned.screen, QuitScreen))
        await pilot.press(key)
        await until(pilot, lambda: not owned.is_running)
    return owned.return_value


def test_quit_asks_only_when_the_dashboard_owns_the_cluster() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 1)
        assert await _quit_owned(fake, "s") == "stop"
        assert await _quit_owned(fake, "l") == "leave"
        attached = app_for(fake)
        async with attached.run_test(size=SIZE) as pilot:
            await pilot.press("q")
            await until(pilot, lambda: not attached.is_running)
        assert attached.return_value is None

    asyncio.run(body())


def test_scale_and_replay_actions_follow_capabilities() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        app = app_for(fake)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state is not None)
            assert app.check_action("scale", ("decode", 1)) is False
            await pilot.press("plus", "space")
            await pilot.pause(0.2)
            assert fake.posts == []
            fake.capabilities = {"scale": True}
            fake.replay = {"status": "running", "sent": 10, "total": 100}
            await until(pilot, lambda: app.capabilities == {"scale", "replay"})
            await pilot.press("plus")
            await until(pilot, lambda: ("/control/scale", {"role": "decode", "delta": 1}) in fake.posts)
            await pilot.press("space")
            await until(pilot, lambda: ("/control/replay/pause", {}) in [(p, b or {}) for p, b in fake.posts])
            await until(pilot, lambda: "paused" in str(app.query_one("#header").render()))
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            con = Console(width=150, file=io.StringIO(), record=True)
            con.print(help_table(set(app.capabilities)))
            text = con.export_text()
            assert "Policy" in text and "Decode+1" in text and "Pause/resume" in text and "Quit" in text
            await pilot.press("escape")

    asyncio.run(body())


def test_command_palette_opens_the_picker() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        app = app_for(fake, autopoll=False)  # an idle app: Pilot's key presses return quickly
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(StateArrived(fake.snapshot()))
            await until(pilot, lambda: app.state is not None)
            await pilot.press("ctrl+p")
            await pilot.press(*"swap routing")
            await until(
                pilot,
                lambda: "Swap routing policy" in str(app.screen.query_one(CommandList).get_option_at_index(0).prompt),
            )
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, PolicyPicker) and app.screen.policy is not None)
            await pilot.pause()  # its form finishes mounting before the app closes

    asyncio.run(body())


def test_sorting_keeps_role_groups() -> None:
    async def body() -> None:
        fake = FakeConsole(2, 4)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(StateArrived(fake.snapshot()))
            table = app.query_one(InstanceTable)
            await until(pilot, lambda: table.row_count == 6)
            table.sort_by("running", reverse=True)
            order = [str(r.key.value) for r in table.ordered_rows]
            assert order[:2] == sorted(order[:2], key=lambda i: -int(table.row_texts(i)["running"])) and set(
                order[:2]
            ) == {"p0", "p1"}
            running = [int(table.row_texts(i)["running"]) for i in order[2:]]
            assert running == sorted(running, reverse=True)
            await pilot.click(InstanceTable, offset=(3, 1))  # header "instance": back to id order
            await until(pilot, lambda: table.sort_column == "id")

    asyncio.run(body())


def test_swap_is_logged_once_without_the_event_stream() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        fake.sse_enabled = False
        app = app_for(fake)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state is not None)
            await app.run_action("pick_policy('routing')")
            await until(pilot, lambda: isinstance(app.screen, PolicyPicker) and app.screen.policy is not None)
            picker = app.screen
            assert isinstance(picker, PolicyPicker)
            options = picker.query_one("#picker-policies", OptionList)
            options.highlighted = options.get_option_index("round_robin")  # sibyl → round_robin, which has no params
            await until(pilot, lambda: picker.policy is not None and picker.policy["name"] == "round_robin")
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, PolicyPicker))
            tick = fake.tick
            await until(pilot, lambda: fake.tick >= tick + 3)  # polls that see the new policy
            swaps = [str(line.text) for line in app.query_one(EventLog).lines if " SWAP " in str(line.text)]
            assert len(swaps) == 1 and "sibyl → round_robin" in swaps[0] and "source tui" in swaps[0]
            fake.policies["routing"] = {"name": "least_load", "params": {"by": "requests"}}  # swapped elsewhere
            await until(pilot, lambda: sum(" SWAP " in str(line.text) for line in app.query_one(EventLog).lines) == 2)
            assert [label for _, label in app.query_one(SloChart).markers()] == [
                "routing→round_robin",
                "routing→least_load",
            ]

    asyncio.run(body())


def test_a_restarted_console_starts_the_charts_over() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2, clock=lambda: 30.0)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(StateArrived(fake.snapshot()))
            await until(pilot, lambda: app.query_one(LoadChart).shown() != [])
            app.query_one(SloChart).add_marker(20.0, "routing→least_load")
            restarted = ConsoleState.model_validate({**fake.state(), "run_id": "r-new", "uptime_s": 1.0})
            app.post_message(StateArrived(restarted))
            await until(pilot, lambda: app.query_one(SloChart).markers() == [])
            assert any("restarted: run r-new" in str(line.text) for line in app.query_one(EventLog).lines)

    asyncio.run(body())


def test_resize_relays_out_the_charts() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2, clock=lambda: 5.0)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(StateArrived(fake.snapshot()))
            chart = app.query_one(LoadChart)
            await until(pilot, lambda: chart.shown() != [])
            wide = chart.size.width
            first = str(chart.render()).splitlines()[0]
            await pilot.resize_terminal(110, 40)
            await until(pilot, lambda: chart.size.width < wide)
            lines = str(chart.render()).splitlines()
            assert lines[0] != first and max(len(line) for line in lines) <= chart.size.width

    asyncio.run(body())


def test_the_header_counts_what_the_decode_instances_prefilled_for_admission() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2, clock=lambda: 5.0)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(StateArrived(fake.snapshot()))
            header = app.query_one("#header")
            await until(pilot, lambda: "run" in str(header.render()))
            assert "prefilled on decode" not in str(header.render())  # none yet: nothing said
            state = fake.state()
            queue = {**(state.get("queue") or {}), "admission": {"served_on_decode": 7, "local_prefill": 1}}
            app.post_message(StateArrived(ConsoleState.model_validate({**state, "queue": queue})))
            await until(pilot, lambda: "prefilled on decode 7" in str(header.render()))

    asyncio.run(body())
