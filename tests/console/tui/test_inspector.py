"""The request inspector with Pilot: `i` on an instance lists its requests; enter shows a request's
decisions. The inspector endpoints answer with the console's own functions over a real dispatcher's
records (console/live/recent.py), behind the fake control API of the other dashboard tests."""

from __future__ import annotations

import asyncio
import io
from typing import Any

from rich.console import Console
from textual.widgets import DataTable

from console.live.recent import RecentRequests, instance_requests, request_decisions
from console.tui.help import help_table
from console.tui.inspector import InspectorScreen
from console.tui.instances import InstanceTable
from core.decision_log import DecisionLog
from core.types import Request
from tests.console.tui.fakes import SIZE, FakeConsole, app_for, until
from tests.helpers import add_running, cluster


class InspectedConsole(FakeConsole):
    """The fake console, plus a dispatcher (2P4D, sibyl) that routed six requests with records on."""

    def __init__(self) -> None:
        super().__init__(2, 4)
        self.d = cluster("sibyl", prefill=2, decode=4)
        self.log = DecisionLog()
        self.d.use_decisions(self.log)
        add_running(self.d, "busy", "d0", prompt=200, generated=5, rate=10.0, now=0.0)
        self.recent = RecentRequests([])
        self.recent._log = self  # rows are kept; nothing else is written
        for k in range(6):
            a = self.d.route(Request(f"req-{k}", 0.0, 100, 20), 0.0)
            self.recent.rows.append(
                {"request_id": f"req-{k}", "status": "ok", "arrival": 0.0, "prompt_tokens": 100, "output_tokens": 20}
                | {"prefill_instance": a.prefill, "decode_instance": a.decode}
            )

    def request(self, row: dict[str, Any]) -> None:
        pass

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        parts = path.strip("/").split("/")
        if method == "GET" and parts[:2] == ["control", "instances"] and parts[3:] == ["requests"]:
            rows = instance_requests(parts[2], {}, self.recent, self.log, lambda t: t, 100)
            return 200, {"instance": parts[2], "requests": rows}
        if method == "GET" and parts[:2] == ["control", "requests"] and parts[3:] == ["decisions"]:
            return 200, request_decisions(parts[2], self.log, 0.0)
        return super().answer(method, path, body)


def test_the_inspector_lists_an_instances_requests_and_shows_a_requests_decisions() -> None:
    async def body() -> None:
        fake = InspectedConsole()
        on_d1 = [r["request_id"] for r in fake.recent.rows if r["decode_instance"] == "d1"]
        assert on_d1
        app = app_for(fake)
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one(InstanceTable)
            await until(pilot, lambda: table.row_count == 6)
            table.move_cursor(row=[r.key.value for r in table.ordered_rows].index("d1"))
            await pilot.press("i")
            await until(pilot, lambda: isinstance(app.screen, InspectorScreen))
            screen = app.screen
            assert isinstance(screen, InspectorScreen) and screen.instance == "d1"
            requests = screen.query_one("#inspector-requests", DataTable)
            await until(pilot, lambda: requests.row_count == len(on_d1))
            assert [r.key.value for r in requests.ordered_rows] == list(reversed(on_d1))  # newest first
            requests.focus()
            await pilot.press("enter")
            await until(pilot, lambda: screen.decisions is not None)
            shown = screen.decisions
            assert shown is not None and shown["request_id"] == on_d1[-1]
            route = [x for x in shown["decisions"] if (x["kind"], x["stage"]) == ("route", "decode")][0]
            assert [c["name"] for c in route["candidates"]] == ["d0", "d1", "d2", "d3"] and route["chosen"] == "d1"
            con = Console(width=150, record=True, file=io.StringIO())
            con.print(screen.rendered)
            text = con.export_text()
            assert "projected_load_at_tau" in text and "▶ d1" in text and "d3" in text
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, InspectorScreen))

    asyncio.run(body())
    con = Console(width=150, record=True, file=io.StringIO())
    con.print(help_table())
    assert "Inspect" in con.export_text()
