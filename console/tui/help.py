"""Modal screens: `?` help listing every binding, and the question a quit asks of a dashboard
that launched its cluster."""

from __future__ import annotations

from rich.table import Table
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from console.tui.actions import ACTIONS, TABLE_KEYS


def help_table(available: set[str] | None = None) -> Table:
    """Every dashboard binding; actions whose capability is missing are marked."""
    t = Table(box=None, expand=True, show_header=True, header_style="bold")
    t.add_column("key", no_wrap=True)
    t.add_column("action", no_wrap=True)
    t.add_column("what it does")
    for a in ACTIONS:
        note = ""
        if a.requires and available is not None and a.requires not in available:
            missing = "no canary is running" if a.requires == "canary" else f"this console does not offer {a.requires}"
            note = f"  ({missing})"
        t.add_row(a.key, a.title, a.help + note)
    for key, what in TABLE_KEYS:
        t.add_row(key, "", what)
    return t


class HelpScreen(ModalScreen[None]):
    """Bindings of the dashboard; any of escape, ? or q closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="help.close")]

    def __init__(self, available: set[str] | None = None) -> None:
        super().__init__()
        self.available = available
        """Capabilities the console advertises (None: unknown)."""

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static("sibyl-console dashboard — keys", id="help-title")
            yield Static(help_table(self.available), id="help-body")
            yield Static("escape closes", id="help-footer")

    def action_close(self) -> None:
        self.dismiss(None)


class QuitScreen(ModalScreen[str | None]):
    """Quitting a dashboard that launched its cluster: stop the cluster, leave it running, or stay.

    Dismisses with "stop", "leave", or None (stay)."""

    BINDINGS = [
        Binding("s", "answer('stop')", "Stop the cluster", id="quit.stop"),
        Binding("l", "answer('leave')", "Leave it running", id="quit.leave"),
        Binding("escape,c", "answer(None)", "Cancel", id="quit.cancel"),
    ]

    def __init__(self, run_id: str | None = None) -> None:
        super().__init__()
        self.run_id = run_id
        """The console's run, for the reattach hint."""

    def compose(self) -> ComposeResult:
        run = f" --run {self.run_id}" if self.run_id else ""
        with Vertical(id="confirm"):
            yield Static("Quit the dashboard: stop the cluster too?", id="confirm-question")
            yield Static(
                "Stop drains in-flight requests and stops every instance this dashboard launched. "
                f"Leave keeps it serving: reattach with `sibyl-console tui{run}`, stop it later with "
                f"`sibyl-console down{' ' + self.run_id if self.run_id else ''}`.",
                id="confirm-detail",
            )
            with Horizontal(id="confirm-buttons"):
                yield Button("Stop (s)", variant="error", id="quit-stop")
                yield Button("Leave running (l)", variant="primary", id="quit-leave")
                yield Button("Cancel (esc)", id="quit-cancel")

    def on_mount(self) -> None:
        self.query_one("#quit-cancel", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss({"quit-stop": "stop", "quit-leave": "leave"}.get(event.button.id or ""))

    def action_answer(self, choice: str | None) -> None:
        self.dismiss(choice)
