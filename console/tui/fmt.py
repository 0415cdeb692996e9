"""Small, pure formatters shared by the dashboard widgets (numbers, bars, sparklines, durations)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from textual.app import App
from textual.color import Color, ColorParseError

BAR_EIGHTHS = " ▏▎▍▌▋▊▉█"
SPARK = "▁▂▃▄▅▆▇█"
ATTAINMENT_OK = 0.9
"""Attainment at or above this is drawn in the theme's success colour."""
ATTAINMENT_WARN = 0.75
"""Attainment below ATTAINMENT_OK but at or above this is drawn as a warning; lower is an error."""


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def bar(fraction: float, width: int) -> str:
    """A left-aligned bar of `width` cells filled to `fraction` (clamped to 0..1), in eighths."""
    f = min(max(fraction, 0.0), 1.0)
    eighths = round(f * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (BAR_EIGHTHS[part] if part else "")
    return text.ljust(width)


def sparkline(values: Iterable[float], scale: float, width: int) -> str:
    """The last `width` values as block characters, 0..scale mapped to ▁..█."""
    vals = list(values)[-width:]
    if scale <= 0:
        scale = 1.0
    chars = [SPARK[min(len(SPARK) - 1, max(0, round(v / scale * (len(SPARK) - 1))))] for v in vals]
    return "".join(chars).rjust(width)


def policy_label(entry: Mapping[str, Any] | None, with_params: bool = True) -> str:
    """`name(k=v, ...)` of an active-policy entry {name, params}."""
    if not entry:
        return "-"
    params = entry.get("params") or {}
    # Switches that are off are left out (ablations default to off); a switch that is on shows its name.
    parts = [k if v is True else f"{k}={v}" for k, v in params.items() if v is not False]
    if not with_params or not parts:
        return str(entry.get("name", "-"))
    inner = ", ".join(parts)
    return f"{entry.get('name')}({inner})"


@dataclass(frozen=True)
class Palette:
    """Rich styles taken from the current Textual theme, so text stays readable on dark and light."""

    ok: str
    warn: str
    bad: str
    accent: str
    muted: str

    @classmethod
    def from_theme(cls, variables: Mapping[str, str], dark: bool) -> Palette:
        """Theme colours; on a light theme darkened so they keep contrast on a pale background."""

        def pick(name: str, fallback: str) -> str:
            try:
                c = Color.parse(variables.get(name, fallback))
            except ColorParseError:
                return fallback
            return (c if dark else c.darken(0.3)).hex

        return cls(
            ok=pick("success", "green"),
            warn=pick("warning", "yellow"),
            bad="bold " + pick("error", "red"),
            accent=pick("primary", "blue"),
            muted="dim",
        )

    def attainment(self, x: float | None) -> str:
        if x is None:
            return self.muted
        if x >= ATTAINMENT_OK:
            return self.ok
        return self.warn if x >= ATTAINMENT_WARN else self.bad


def palette_for(app: App[Any]) -> Palette:
    """The palette of the app's current theme."""
    return Palette.from_theme(app.theme_variables, app.current_theme.dark)
