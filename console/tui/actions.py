"""The dashboard's actions as data: one list drives the key bindings, the footer, `?` and the palette."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding, BindingType


@dataclass(frozen=True)
class DashboardAction:
    """One operator action, shown the same way in the footer, the help screen and the palette."""

    id: str
    """Binding id (stable; users can remap it through Textual keymaps)."""
    key: str
    """Key as typed ("+", "?", "space", ...)."""
    action: str
    """Textual action string, e.g. `scale('decode', 1)`."""
    title: str
    """Short label for the footer and the palette."""
    help: str
    """One sentence for the help screen and the palette."""
    show: bool = True
    """Whether the footer shows it."""
    requires: str | None = None
    """Capability the console must advertise (`scale`, `role_flip`, `replay`; `canary` while one runs); hidden
    without it."""


ACTIONS: tuple[DashboardAction, ...] = (
    DashboardAction(
        "dashboard.policy",
        "p",
        "pick_policy",
        "Policy",
        "Swap a policy: pick kind, policy and params; applied through the control API.",
    ),
    DashboardAction(
        "dashboard.canary",
        "c",
        "pick_policy('routing', True)",
        "Canary",
        "Start a policy canary: the picker with `canary` chosen; a share of new requests (default 10%) runs under the "
        "candidate for a while (default 5m), then the verdict.",
        show=False,
    ),
    DashboardAction(
        "dashboard.stop_canary",
        "x",
        "stop_canary",
        "Stop canary",
        "Stop (roll back) the running canary, after a confirmation: it ends interrupted, the active policy stays.",
        requires="canary",
    ),
    DashboardAction(
        "dashboard.sort", "s", "sort", "Sort", "Sort the instance table by the next column (or click a column header)."
    ),
    DashboardAction(
        "dashboard.decode_up", "+", "scale('decode', 1)", "Decode+1", "Add one decode instance.", requires="scale"
    ),
    DashboardAction(
        "dashboard.decode_down", "-", "scale('decode', -1)", "Decode-1", "Remove one decode instance.", requires="scale"
    ),
    DashboardAction(
        "dashboard.prefill_up",
        ">",
        "scale('prefill', 1)",
        "Prefill+1",
        "Add one prefill instance.",
        show=False,
        requires="scale",
    ),
    DashboardAction(
        "dashboard.prefill_down",
        "<",
        "scale('prefill', -1)",
        "Prefill-1",
        "Remove one prefill instance.",
        show=False,
        requires="scale",
    ),
    DashboardAction(
        "dashboard.flip",
        "f",
        "flip_selected",
        "Flip",
        "Flip the selected instance between prefill and decode.",
        requires="role_flip",
    ),
    DashboardAction(
        "dashboard.inspect",
        "i",
        "inspect_selected",
        "Inspect",
        "Request inspector: the selected instance's recent requests; enter on one shows its decisions, "
        "every candidate with the features and score the policy saw.",
        show=False,
    ),
    DashboardAction(
        "dashboard.replay",
        "space",
        "toggle_replay",
        "Pause/resume",
        "Pause or resume the replay started by `up --replay`.",
        requires="replay",
    ),
    DashboardAction(
        "dashboard.theme", "t", "toggle_theme", "Light/dark", "Switch between the dark and the light theme."
    ),
    DashboardAction("dashboard.help", "?", "help", "Help", "Show every key binding."),
    DashboardAction(
        "dashboard.quit", "q", "quit", "Quit", "Quit; a dashboard that launched the cluster asks before stopping it."
    ),
)

TABLE_KEYS: tuple[tuple[str, str], ...] = (
    ("↑/↓, PgUp/PgDn", "move in the instance table"),
    ("click a header", "sort by that column (again: reverse)"),
    (
        "load bar, trend",
        "projected load vs the busiest instance of the same role (running + waiting where the policy projects none)",
    ),
    ("ctrl+p", "command palette: every action above, plus one entry per policy kind"),
    ("tab / shift+tab", "move focus between table, log and charts"),
    ("ctrl+q", "quit (same as q)"),
)
"""Keys that come from widgets or Textual itself, listed on the help screen."""

POLICY_KINDS: tuple[str, ...] = ("routing", "queue", "reschedule", "scaling", "rank")


def bindings() -> list[BindingType]:
    return [Binding(a.key, a.action, a.title, show=a.show, id=a.id) for a in ACTIONS]


def action_name(action: str) -> str:
    """`scale('decode', 1)` → `scale`."""
    return action.split("(", 1)[0]


def requirement(name: str) -> str | None:
    """The capability an action (by name) needs, if any."""
    for a in ACTIONS:
        if action_name(a.action) == name and a.requires:
            return a.requires
    return None
