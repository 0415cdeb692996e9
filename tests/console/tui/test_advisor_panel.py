"""The dashboard's advisor panel on a real two-pool console's control API (127.0.0.1): its title names the pool the
advisor advises on (`[advisor] pool`), as the state carries it; the ranking below it is as before."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from rich.console import Console
from textual.geometry import Region

from console.tui.advisor import AdvisorPanel
from console.tui.app import SibylDashboard
from console.tui.client import DashboardClient
from tests.console.advisor.fakes import advise_once, served, two_pool_controller
from tests.console.tui.fakes import SIZE, until


def text_of(panel: AdvisorPanel) -> str:
    """What the panel shows inside its border, as plain text."""
    out = Console(width=156, file=io.StringIO(), record=True)
    out.print(panel.render())
    return out.export_text()


def top_border(panel: AdvisorPanel) -> str:
    """The panel's top border line as drawn, title included."""
    (line,) = panel.render_lines(Region(0, 0, panel.outer_size.width, 1))
    return line.text


def test_the_panel_title_names_the_pool_the_advisor_advises_on(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path, advisor=True, advisor_pool="b")
    advise_once(c)

    async def ui(url: str) -> None:
        client = DashboardClient(url, c.token)
        app = SibylDashboard(client, poll_interval_s=0.1)
        try:
            async with app.run_test(size=SIZE) as pilot:
                panel = app.query_one(AdvisorPanel)
                await until(pilot, lambda: panel.display and bool((panel.advisor or {}).get("advice")))
                await pilot.pause()
                assert panel.border_title == "advisor · pool b"
                assert "advisor · pool b" in top_border(panel)
                shown = text_of(panel)
                assert "candidate" in shown and "routing:least_load" in shown and "active" in shown
                # a state that names no pool (a console from before pools were named): the plain title
                panel.show({k: v for k, v in (panel.advisor or {}).items() if k != "pool"}, panel.canary)
                assert panel.border_title == "advisor"
        finally:
            await client.aclose()

    with served(c) as url:
        asyncio.run(ui(url))
    c.recorder.close()
