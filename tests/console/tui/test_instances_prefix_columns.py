"""The instance table shows each instance's prefix-cache hit rate and cached share (or "-" when unknown)."""

from __future__ import annotations

import asyncio

from console.tui.instances import InstanceTable
from console.tui.messages import StateArrived
from tests.console.tui.fakes import SIZE, FakeConsole, app_for, until


def test_hit_and_cached_columns() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            snap = fake.snapshot()
            rows = [
                r.model_copy(update={"prefix_hit_rate": 0.42, "cached_share": 0.3}) if r.id == "p0" else r
                for r in snap.instances
            ]
            app.post_message(StateArrived(snap.model_copy(update={"instances": rows})))
            table = app.query_one(InstanceTable)
            await until(pilot, lambda: table.row_texts("p0").get("hit") == "42%")
            assert table.row_texts("p0")["cached"] == "30%"
            assert table.row_texts("d0")["hit"] == "-" and table.row_texts("d0")["cached"] == "-"

    asyncio.run(body())
