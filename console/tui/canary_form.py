"""The policy picker's last step: swap now, or start a canary (share, duration), checked by the console's own rules."""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass, field
from types import ModuleType

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Label, RadioButton, RadioSet, Static

from console.commands.policy_canary import parse_duration
from core.errors import SibylError

RULES_MODULE = "console.advisor.canary"
"""The console's canary checks (`check_kind`, `parse_share`); it imports scipy, so the picker imports it in a thread
the first time a canary is asked for."""
DEFAULT_SHARE = "10%"
DEFAULT_DURATION = "5m"


async def canary_rules() -> ModuleType:
    """console/advisor/canary.py, imported off the event loop (the import is cached after the first)."""
    return await asyncio.to_thread(importlib.import_module, RULES_MODULE)


@dataclass(frozen=True)
class CanaryAsk:
    """A canary as the operator asked for it, or why it cannot be asked for."""

    share: str = ""
    """As typed ("10%", "0.1"): sent as is, as the CLI sends its --share."""
    duration_s: float = 0.0
    refusal: str | None = None
    """Why no canary can run for this kind (None: it can)."""
    errors: dict[str, str] = field(default_factory=dict)
    """By field: `share`, `for`."""

    @property
    def ok(self) -> bool:
        return self.refusal is None and not self.errors


def refusal(rules: ModuleType, kind: str) -> str | None:
    """Why a canary of `kind` cannot be started from the picker: the console's message for a kind it cannot split
    (any pool can be canaried: the picker sends the pool chosen)."""
    try:
        rules.check_kind(kind)
    except SibylError as e:
        return str(e)
    return None


def check(rules: ModuleType, kind: str, share: str, duration: str) -> CanaryAsk:
    """The share under the console's rule (in (0, 50%]) and the duration as `policy canary --for` reads it."""
    errors: dict[str, str] = {}
    try:
        rules.parse_share(share)
    except SibylError as e:
        errors["share"] = str(e)
    seconds = 0.0
    try:
        seconds = parse_duration(duration)
    except SibylError as e:
        errors["for"] = str(e)
    return CanaryAsk(share.strip(), seconds, refusal(rules, kind), errors)


class CanaryForm(Vertical):
    """`swap now` | `canary`; with canary, its share and duration and whatever stops it."""

    def __init__(self, canary: bool = False, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._initial = canary

    def compose(self) -> ComposeResult:
        with Horizontal(classes="param-row"):
            yield Label("apply as", classes="param-label")
            yield RadioSet(
                RadioButton("swap now", value=not self._initial, id="mode-swap"),
                RadioButton("canary", value=self._initial, id="mode-canary"),
                id="picker-mode",
                compact=True,
            )
            with Horizontal(id="canary-fields"):
                yield Label("share", classes="canary-label")
                yield Input(DEFAULT_SHARE, placeholder="10%", id="canary-share", compact=True)
                yield Label("for", classes="canary-label")
                yield Input(DEFAULT_DURATION, placeholder="5m", id="canary-for", compact=True)
        yield Static(
            "share: of new requests, in (0, 50%], hashed by session, else tenant, else request; "
            "for: 300, 90s, 5m or 1h, then the verdict (promote, roll back, equal or inconclusive)",
            id="canary-help",
        )
        yield Static("", id="canary-share-error", classes="param-error")
        yield Static("", id="canary-for-error", classes="param-error")
        yield Static("", id="canary-note")

    def on_mount(self) -> None:
        self._show_fields()

    @property
    def canary(self) -> bool:
        """Whether the operator chose a canary rather than a swap."""
        return self.query_one("#mode-canary", RadioButton).value

    @on(RadioSet.Changed, "#picker-mode")
    def _mode_changed(self) -> None:
        self._show_fields()

    def _show_fields(self) -> None:
        for wid in ("#canary-fields", "#canary-help", "#canary-note"):
            self.query_one(wid).display = self.canary
        if not self.canary:
            self.show(CanaryAsk())

    def choose(self, canary: bool) -> None:
        """Select a mode (as a click on its button would)."""
        self.query_one("#mode-canary" if canary else "#mode-swap", RadioButton).value = True

    def texts(self) -> tuple[str, str]:
        """(share, duration) as typed."""
        return self.query_one("#canary-share", Input).value, self.query_one("#canary-for", Input).value

    def show(self, ask: CanaryAsk) -> None:
        """Mark the fields in error and say why no canary can run, if so."""
        for name in ("share", "for"):
            label = self.query_one(f"#canary-{name}-error", Static)
            label.update(ask.errors.get(name, ""))
            label.display = name in ask.errors
        self.query_one("#canary-note", Static).update(ask.refusal or "")

    def fields_named_in(self, message: str) -> dict[str, str]:
        """The console's refusal of a canary (422) onto the field it is about, else none."""
        if message.startswith("canary share"):
            return {"share": message}
        if message.startswith("canary duration"):
            return {"for": message}
        return {}
