"""The advisor panel: candidates ranked with their gain over the active policies (only past the advisor's error, with
that error as the interval), and the policy canary (canary_view.py). Hidden while the console has neither."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from console.tui.canary_view import canary_view
from console.tui.fmt import ms, palette_for, pct

SHOWN = 4
"""Candidates listed (the best ones; the active policies always)."""


def signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def gain(entry: dict[str, Any], bound: dict[str, Any]) -> str:
    """The gain over the active policies with the advisor's error as its interval; "within error" when it does not
    clear it."""
    if entry.get("active"):
        return "active"
    if not entry.get("shown"):
        return "within error"
    g = entry.get("gain") or {}
    parts = []
    for key, label in (("ttft_p99", "P99 TTFT"), ("attainment", "attain")):
        if g.get(key) is not None:
            err = bound.get(key)
            parts.append(f"{label} {signed(g[key])}" + ("" if err is None else f" ±{err:.0%}"))
    return ", ".join(parts)


class AdvisorPanel(Widget):
    """The app calls `show` with the state's `advisor` and `canary` objects each refresh; the title names the pool
    the advisor advises on."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.advisor: dict[str, Any] | None = None
        self.canary: dict[str, Any] | None = None
        self.display = False

    def show(self, advisor: dict[str, Any] | None, canary: dict[str, Any] | None) -> None:
        self.advisor, self.canary = advisor, canary
        pool = (advisor or {}).get("pool")
        self.border_title = Text(f"advisor · pool {pool}" if pool else "advisor")  # Text: a name is not markup
        running = bool(canary and (canary.get("running") or canary.get("last")))
        self.display = advisor is not None or running
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        p = palette_for(self.app)
        a = self.advisor or {}
        advice = a.get("advice")
        parts: list[RenderableType] = []
        if a and advice is None:
            why = a.get("error") or "the first period has not ended"
            parts.append(Text(f"advisor: no advice yet ({why})", p.muted))
        if advice is not None:
            err, bound = advice.get("error"), advice.get("bound") or {}
            error = "unknown (policies mixed in the window)" if err is None else (
                f"{pct(err.get('ttft_p99'))} on P99 TTFT, {pct(err.get('attainment'))} on attainment"
            )
            cpu = a.get("cpu_share")
            self.border_subtitle = f"error {error} · worker {'-' if cpu is None else f'{cpu:.1%}'} of a core"
            t = Table(box=None, expand=True, pad_edge=False, show_edge=False)
            t.add_column("candidate", no_wrap=True)
            t.add_column("P99 TTFT ms", justify="right", no_wrap=True)
            t.add_column("attain", justify="right", no_wrap=True)
            t.add_column("gain over active", no_wrap=True)
            ranked = advice.get("ranked") or []
            listed = [r for i, r in enumerate(ranked) if i < SHOWN or r.get("active")]
            for r in listed:
                style = p.accent if r.get("shown") and r.get("label") == advice.get("best") else ""
                t.add_row(
                    Text(r["label"], style),
                    ms(r.get("ttft_p99")),
                    Text(pct(r.get("attainment")), p.attainment(r.get("attainment"))),
                    gain(r, bound),
                )
            parts.append(t)
            if a.get("detail"):
                parts.append(Text(str(a["detail"]), p.muted))
        parts.extend(canary_view(self.canary, p))
        return Group(*parts)
