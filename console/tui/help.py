"""Modal screens: `?` help listing every binding, and the yes/no confirmation before stopping a cluster."""

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
            note = f"  (this console does not offer {a.requires})"
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


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; dismisses with True for yes."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question = question
        """The question, e.g. "Stop the cluster?"."""
        self.detail = detail
        """What yes will do."""

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(self.question, id="confirm-question")
            if self.detail:
                yield Static(self.detail, id="confirm-detail")
            with Horizontal(id="confirm-buttons"):
                yield Button("Yes (y)", variant="error", id="confirm-yes")
                yield Button("No (n)", variant="primary", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
