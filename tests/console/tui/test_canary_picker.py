"""The picker's canary step without a console: what it sends (the CLI's defaults, 5m read as 300 s, the pool chosen
when the console runs several, none when it runs one), and an interval an arm cannot bound."""

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


def start_from_picker(catalogue: dict[str, Any], pool: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Open the picker with canary chosen, pick `pool` (None: leave it), apply; what the canary call got."""
    started: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def swap(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("a canary was asked for, not a swap")

    async def canary(*args: Any, **kwargs: Any) -> dict[str, Any]:
        started.append((args, kwargs))
        return {"id": "canary-1", "plan": {"kind": args[0], "name": args[1], "share": 0.1, "duration_s": args[4]}}

    picker = PolicyPicker(catalogue, swap, canary=canary, as_canary=True)
    results: list[dict[str, Any] | None] = []

    async def body() -> None:
        app: App[None] = App()
        async with app.run_test() as pilot:
            await app.push_screen(picker, results.append)
            await until(pilot, lambda: picker.policy is not None and picker.canary_chosen)
            if pool is not None:
                picker.query_one("#picker-pool", Select).value = pool
                await until(pilot, lambda: picker.pool == pool)
            await pilot.pause()
            assert str(picker.query_one("#canary-note", Static).render()) == ""  # any pool can be canaried
            picker.action_apply()
            await until(pilot, lambda: bool(results))

    asyncio.run(body())
    assert results[0] is not None and results[0]["id"] == "canary-1"
    (call,) = started
    return call


def test_the_picker_starts_a_canary_on_the_pool_chosen() -> None:
    pools = {"A": {"routing": ROUND_ROBIN}, "B": {"routing": ROUND_ROBIN}}
    several = {"active": pools["A"], "pools": pools, "available": catalog(live=True)}
    assert start_from_picker(several, "B") == (("routing", "round_robin", {}, "10%", 300.0), {"pool": "B"})
    assert start_from_picker(several, None) == (("routing", "round_robin", {}, "10%", 300.0), {"pool": "A"})
    one: dict[str, Any] = {"active": {"routing": ROUND_ROBIN}, "pools": {"m": {"routing": ROUND_ROBIN}}}
    one["available"] = catalog(live=True)
    assert start_from_picker(one, None) == (("routing", "round_robin", {}, "10%", 300.0), {})  # one pool: none named


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
