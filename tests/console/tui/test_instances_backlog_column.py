"""The instance table shows each prefill instance's projected backlog (the one admission judges by)
beside the engine's own waiting count, and, once instances are calibrated, whether each is."""

from __future__ import annotations

import asyncio

from console.live.state import InstanceCalibration
from console.tui.events import describe
from console.tui.fmt import Palette
from console.tui.instances import InstanceTable
from console.tui.messages import StateArrived
from tests.console.tui.fakes import SIZE, FakeConsole, app_for, until


def test_backlog_and_calibration_columns() -> None:
    async def body() -> None:
        fake = FakeConsole(1, 2)
        app = app_for(fake, autopoll=False)
        async with app.run_test(size=SIZE) as pilot:
            snap = fake.snapshot()
            fitted = InstanceCalibration.model_validate(
                {
                    "calibrated": True,
                    "fitted_age_s": 2.0,
                    "terms": {
                        "prefill_per_token_s": {"value": 2e-5, "prior": 2e-4, "source": "fit", "residual": 0.07},
                        "kv_transfer_base_s": {"value": 0.01, "prior": 0.01, "source": "prior: no samples yet"},
                    },
                }
            )
            rows = [
                r.model_copy(update={"backlog_s": 2.94, "waiting": 0, "calibration": fitted}) if r.id == "p0" else r
                for r in snap.instances
            ]
            app.post_message(StateArrived(snap.model_copy(update={"instances": rows})))
            table = app.query_one(InstanceTable)
            await until(pilot, lambda: table.row_texts("p0").get("backlog") == "2.94s")
            assert table.row_texts("p0")["waiting"] == "0" and table.row_texts("p0")["calib"] == "fit ±7%"
            assert table.row_texts("d0")["backlog"] == "-" and table.row_texts("d0")["calib"] == "-"

    asyncio.run(body())


def test_a_refusal_line_is_one_counted_line_per_cause() -> None:
    event = {"type": "refusals", "time": 0.0, "cause": "prefill_backlog", "count": 37, "detail": "prefill backlog: 37"}
    tag, text, _ = describe(event, Palette("green", "yellow", "red", "cyan", "dim"))
    assert (tag, text) == ("REFUSE", "prefill backlog: 37")
