"""The policy canary in the advisor panel: the running one (candidate, share, time left, requests per arm, each figure
of both arms with the difference's interval) or the last one's verdict, from the state's `canary` object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from console.live.canary import READING_EVERY_S
from console.tui.fmt import Palette, duration, ms, pct, policy_label

FIGURES = {"attainment": "attainment", "ttft_p99": "P99 TTFT", "tpot_p99": "P99 TPOT"}
"""The figures a reading compares, as the panel names them."""
VERDICT_STYLE = {"promote": "ok", "equal": "ok", "rollback": "bad", "inconclusive": "warn", "interrupted": "warn"}
"""A verdict's palette entry."""


def signed(x: float | None, *, low: bool) -> str:
    """A relative difference; None is an unbounded end of an interval (a P99 interval an arm cannot bound)."""
    if x is None:
        return "−∞" if low else "+∞"
    return f"{x:+.1%}"


def figure_value(figure: str, x: float | None) -> str:
    """Attainment as a percentage, a P99 in ms."""
    return pct(x) if figure == "attainment" else ("-" if x is None else f"{ms(x)} ms")


def direction_style(direction: str, p: Palette) -> str:
    return {"better": p.ok, "worse": p.bad, "equal": p.ok}.get(direction, p.muted)


def figures_table(figures: list[Mapping[str, Any]], p: Palette) -> Table:
    """One row per figure: both arms, the difference (attainment: canary − control; P99s: canary ÷ control − 1) with
    its interval at the reading's confidence, and what the interval says."""
    confidence = min((float(f.get("confidence") or 0.0) for f in figures), default=0.0)
    t = Table(box=None, expand=False, pad_edge=False, show_edge=False, padding=(0, 2, 0, 0))
    t.add_column("  figure", no_wrap=True)
    t.add_column("canary", justify="right", no_wrap=True)
    t.add_column("control", justify="right", no_wrap=True)
    t.add_column("difference", justify="right", no_wrap=True)
    t.add_column(f"{confidence:.1%} interval" if confidence else "interval", no_wrap=True)
    t.add_column("says", no_wrap=True)
    for f in figures:
        name = str(f.get("figure"))
        difference = f.get("difference")
        direction = str(f.get("direction") or "unclear")
        t.add_row(
            "  " + FIGURES.get(name, name),
            figure_value(name, f.get("canary")),
            figure_value(name, f.get("control")),
            "-" if difference is None else signed(difference, low=False),
            f"[{signed(f.get('low'), low=True)}, {signed(f.get('high'), low=False)}]",
            Text(direction, direction_style(direction, p)),
        )
    return t


def title(c: Mapping[str, Any]) -> str:
    """`canary ID: KIND POLICY(params) on SHARE`."""
    plan = c["plan"]
    candidate = policy_label({"name": plan["name"], "params": plan.get("params")})
    return f"canary {c['id']}: {plan['kind']} {candidate} on {plan['share']:.0%}"


def time_left(c: Mapping[str, Any]) -> str:
    """`1m32s left of 5m00s`."""
    elapsed, length = float(c.get("elapsed_s") or 0.0), float(c["plan"]["duration_s"])
    return f"{duration(max(length - elapsed, 0.0))} left of {duration(length)}"


def arms(c: Mapping[str, Any]) -> str:
    """The requests each arm finished since the start (what a reading compares)."""
    done = c.get("finished") or {}
    return f"requests finished: {done.get('canary', 0)} canary, {done.get('control', 0)} control"


def canary_view(canary: Mapping[str, Any] | None, p: Palette) -> list[RenderableType]:
    """The running canary (else the last one's verdict): what it tries, its latest reading, the figures."""
    if not canary:
        return []
    c, ended = canary.get("running"), False
    if c is None:
        c, ended = canary.get("last"), True
    if c is None:
        return []
    out: list[RenderableType] = []
    reading = c.get("reading") or {}
    if ended:
        decision = str(c.get("decision"))
        style = getattr(p, VERDICT_STYLE.get(decision, "warn"))
        out.append(Text.assemble((f"canary {c['id']} ended: {decision}", f"bold {style}"), f" — {c.get('reason')}"))
        out.append(Text(f"  {title(c).split(': ', 1)[1]} · ran {duration(c.get('elapsed_s'))} · {arms(c)}", p.muted))
    else:
        out.append(Text.assemble((f"{title(c)} · {time_left(c)}", p.accent), ("  (x stops it)", p.muted)))
        every = max(min(READING_EVERY_S, float(c["plan"]["duration_s"]) / 4), 1.0)
        when = (
            f"reading {c.get('readings')} at {duration(reading.get('elapsed_s'))}: {reading.get('decision')}"
            if reading
            else "no reading yet"
        )
        out.append(Text(f"  {arms(c)} · {when} (one every {every:g} s)", p.muted))
    if reading.get("figures"):
        out.append(figures_table(list(reading["figures"]), p))
    return out
