"""The request inspector: an instance's recent requests, and the chosen one's decisions candidate by candidate."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from console.tui.client import ApiError, ConnectionLost, DashboardClient
from console.why_tables import decision_table, num

COLUMNS = (
    ("request_id", "request"),
    ("step", "step"),
    ("arrival", "arrival s"),
    ("prompt_tokens", "prompt"),
    ("output_tokens", "output"),
    ("prefill_instance", "prefill"),
    ("decode_instance", "decode"),
    ("decisions", "records"),
)


class InspectorScreen(ModalScreen[None]):
    """Opened on an instance (`i` in the instance table): its requests, newest first; enter (or a
    click) on one shows every decision taken on it, each candidate with its features and score as
    the policy saw them. `r` reloads the list; escape closes."""

    DEFAULT_CSS = """
    InspectorScreen { align: center middle; }
    #inspector { width: 96%; height: 92%; border: round $accent; background: $surface; padding: 0 1; }
    #inspector-requests { height: 40%; }
    #inspector-decisions { height: 1fr; border-top: solid $accent; }
    #inspector-title, #inspector-footer { height: 1; }
    """
    BINDINGS = [
        Binding("escape,q", "close", "Close", id="inspector.close"),
        Binding("r", "reload", "Reload", id="inspector.reload"),
    ]

    def __init__(self, client: DashboardClient, instance: str) -> None:
        super().__init__()
        self.client = client
        self.instance = instance
        """The instance whose requests are listed."""
        self.rows: list[dict[str, Any]] = []
        self.shown: str | None = None
        """The request whose decisions are shown."""
        self.decisions: dict[str, Any] | None = None
        """The last answer of GET /control/requests/{id}/decisions."""
        self.rendered: Group | None = None
        """What the decision pane shows: a table per decision."""

    def compose(self) -> ComposeResult:
        with Vertical(id="inspector"):
            yield Static(f"requests on {self.instance} — enter: its decisions", id="inspector-title")
            yield DataTable(id="inspector-requests", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="inspector-decisions"):
                yield Static("pick a request", id="inspector-body")
            yield Static("enter: decisions · r: reload · escape: close", id="inspector-footer")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        self.load()

    @work(exclusive=True, group="inspector-list", exit_on_error=False)
    async def load(self) -> None:
        try:
            answer = await self.client.instance_requests(self.instance)
        except (ConnectionLost, ApiError) as e:
            self.query_one("#inspector-body", Static).update(f"cannot list {self.instance}'s requests: {e}")
            return
        self.rows = answer.get("requests", [])
        table = self.query_one(DataTable)
        table.clear()
        for r in self.rows:
            cells = [num(r.get(k)) for k, _ in COLUMNS[:-1]]
            table.add_row(*cells, "yes" if r.get("decisions") else "-", key=str(r["request_id"]))
        if not self.rows:
            self.query_one("#inspector-body", Static).update(f"no recent requests on {self.instance}")

    @on(DataTable.RowSelected, "#inspector-requests")
    def _selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.show_request(str(event.row_key.value))

    @work(exclusive=True, group="inspector-decisions", exit_on_error=False)
    async def show_request(self, request_id: str) -> None:
        body = self.query_one("#inspector-body", Static)
        try:
            answer = await self.client.request_decisions(request_id)
        except (ConnectionLost, ApiError) as e:
            body.update(f"cannot read {request_id}'s decisions: {e}")
            return
        self.shown, self.decisions = request_id, answer
        records = answer.get("decisions") or []
        if not records:
            body.update(Text(answer.get("note") or f"no decisions recorded for {request_id}"))
            return
        self.rendered = Group(
            Text(f"{request_id}: {len(records)} decisions", style="bold"), *map(decision_table, records)
        )
        body.update(self.rendered)

    def action_reload(self) -> None:
        self.load()

    def action_close(self) -> None:
        self.dismiss(None)
