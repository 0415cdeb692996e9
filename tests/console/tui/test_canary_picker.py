"""The picker's canary step without a console: what it sends (the CLI's defaults, 5m read as 300 s), a pool other
than the first refused (the control API canaries the first pool only), and an interval an arm cannot bound."""

from __future__ import annotations

import asyncio
import io
from typing import Any

from rich.console import Console
from textual.app import App
from textual.widgets import Select, Static

from console.tui.canary_view import figures_table
from console.tui.fmt import Palette
from console.tui.policy_picker import PolicyPicker
from core.policies.registry import catalog
from tests.console.tui.fakes import until

ROUND_ROBIN = {"name": "round_robin", "params": {}}


def test_the_picker_starts_a_canary_on_the_first_pool_only() -> None:
    started: list[tuple[Any, ...]] = []

    async def swap(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("a canary was asked for, not a swap")

    async def canary(*args: Any) -> dict[str, Any]:
        started.append(args)
        return {"id": "canary-1", "plan": {"kind": args[0], "name": args[1], "share": 0.1, "duration_s": args[4]}}

    pools = {"A": {"routing": ROUND_ROBIN}, "B": {"routing": ROUND_ROBIN}}
    picker = PolicyPicker(
        {"active": pools["A"], "pools": pools, "available": catalog(live=True)}, swap, canary=canary, as_canary=True
    )
    results: list[dict[str, Any] | None] = []

    async def body() -> None:
        app: App[None] = App()
        async with app.run_test() as pilot:
            await app.push_screen(picker, results.append)
            await until(pilot, lambda: picker.policy is not None and picker.canary_chosen)
            picker.query_one("#picker-pool", Select).value = "B"
            note = picker.query_one("#canary-note", Static)
            await until(pilot, lambda: "first pool (A) only" in str(note.render()))
            picker.action_apply()
            error = picker.query_one("#picker-error", Static)
            await until(pilot, lambda: "first pool (A) only" in str(error.render()))
            assert started == []
            picker.query_one("#picker-pool", Select).value = "A"
            await until(pilot, lambda: picker.pool == "A" and str(note.render()) == "")
            picker.action_apply()
            await until(pilot, lambda: bool(results))

    asyncio.run(body())
    (args,) = started
    assert args == ("routing", "round_robin", {}, "10%", 300.0)
    assert results[0] is not None and results[0]["id"] == "canary-1"


def test_an_interval_an_arm_cannot_bound_reads_infinite() -> None:
    """compare_p99 gives high = inf when the control's P99 interval reaches 0; JSON carries it as null."""
    figure = {
        "figure": "ttft_p99", "canary": 0.4, "control": 0.5, "difference": -0.2, "low": -0.5, "high": None,
        "confidence": 0.99, "direction": "unclear",
    }
    out = Console(width=120, file=io.StringIO(), record=True)
    out.print(figures_table([figure], Palette("green", "yellow", "red", "blue", "dim")))
    row = next(line for line in out.export_text().splitlines() if "P99 TTFT" in line)
    assert row.split() == ["P99", "TTFT", "400", "ms", "500", "ms", "-20.0%", "[-50.0%,", "+∞]", "unclear"]
