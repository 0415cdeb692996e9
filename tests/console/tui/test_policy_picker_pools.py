"""The policy picker on a console with several pools: a pool selector, each pool's active policies, the swap sent for
the pool chosen; with one pool no selector and the swap names none."""

from __future__ import annotations

import asyncio
from typing import Any

from textual.app import App
from textual.widgets import Select, Static

from console.tui.policy_picker import PolicyPicker
from core.policies.registry import catalog
from tests.console.tui.fakes import until

ROUND_ROBIN = {"name": "round_robin", "params": {}}
LEAST_LOAD = {"name": "least_load", "params": {"by": "requests", "bind": "arrival"}}


def run(pools: dict[str, Any]) -> tuple[list[tuple[tuple[Any, ...], dict[str, Any]]], list[str]]:
    """Open the picker on `pools`' catalogue, choose pool B when there is one, apply; (the swaps sent, what the
    picker showed as active before and after the choice)."""
    sent: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    shown: list[str] = []

    async def apply(*args: Any, **kwargs: Any) -> dict[str, Any]:
        sent.append((args, kwargs))
        return {"kind": args[0], "old": "x", "new": args[1], "params": args[2], "source": "tui"}

    active = next(iter(pools.values())) if pools else {"routing": ROUND_ROBIN}
    picker = PolicyPicker({"active": active, "pools": pools, "available": catalog(live=True)}, apply)

    async def body() -> None:
        app: App[None] = App()
        async with app.run_test() as pilot:
            await app.push_screen(picker)
            await until(pilot, lambda: picker.policy is not None)
            shown.append(str(picker.query_one("#picker-active", Static).render()))
            if len(pools) > 1:
                picker.query_one("#picker-pool", Select).value = "B"
                await until(pilot, lambda: picker.pool == "B")
                await pilot.pause()
                shown.append(str(picker.query_one("#picker-active", Static).render()))
            else:
                assert not picker.query("#picker-pool")
            picker.action_apply()
            await until(pilot, lambda: bool(sent))

    asyncio.run(body())
    return sent, shown


def test_the_picker_swaps_the_policy_of_the_pool_chosen() -> None:
    sent, shown = run({"A": {"routing": ROUND_ROBIN}, "B": {"routing": LEAST_LOAD}})
    assert shown == ["active: round_robin", "active: least_load"]
    (args, kwargs), = sent
    assert args[:2] == ("routing", "least_load") and kwargs == {"pool": "B"}


def test_with_one_pool_the_picker_names_no_pool() -> None:
    sent, shown = run({"only": {"routing": ROUND_ROBIN}})
    assert shown == ["active: round_robin"]
    (args, kwargs), = sent
    assert args[:2] == ("routing", "round_robin") and kwargs == {}
