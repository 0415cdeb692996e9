"""The event log: policy swaps, instances up/down, failures, refusals by cause, scaling, replay, connection notes."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from rich.text import Text
from textual.widgets import RichLog

from console.live.state import ReplayProgress
from console.tui.fmt import Palette, palette_for, policy_label
from console.tui.header import replay_label

_SKIP = {"type", "time"}


def describe(event: Mapping[str, Any], p: Palette) -> tuple[str, str, str]:
    """(tag, text, style) for one control-API event."""
    kind = str(event.get("type", "?"))
    if kind == "policy":
        new = policy_label({"name": event.get("new"), "params": event.get("params")})
        text = f"{event.get('kind')}: {event.get('old') or '-'} → {new}  (source {event.get('source', '?')})"
        return "SWAP", text, p.accent
    if kind == "instance":
        what = str(event.get("event", "?"))
        detail = f": {event['detail']}" if event.get("detail") else ""
        source = f"  (source {event['source']})" if event.get("source") else ""
        text = f"{event.get('instance')} ({event.get('role') or '?'}) {what.upper()}{detail}{source}"
        if what == "up":
            return "UP", text, p.ok
        if what in ("down", "failed", "refused", "circuit_open"):
            return what.upper()[:6], text, p.bad
        return "SCALE", text, p.warn  # starting, added, draining, removed, flipped
    if kind == "failure":
        where = f"{event.get('prefill') or '-'} → {event.get('decode') or '-'}"
        return "FAIL", f"request {event.get('request_id')} failed: {event.get('reason')}  ({where})", p.bad
    if kind == "refusals":  # one line per cause per few seconds (console/live/refusals.py), not one per request
        return "REFUSE", str(event.get("detail") or f"{event.get('cause')}: {event.get('count')} refused"), p.warn
    if kind == "recovered":
        return "MOVED", f"request {event.get('request_id')} saved: {event.get('detail')}", p.warn
    if kind == "ranks":
        loads = "/".join(str(x) for x in event.get("loads") or [])
        if event.get("balanced"):
            return (
                "RANKS",
                f"{event.get('instance')} ranks balanced again: x{event.get('factor')} ({loads} KV tokens)",
                p.ok,
            )
        return (
            "RANKS",
            (
                f"{event.get('instance')} ranks imbalanced: rank {event.get('busiest')} at x{event.get('factor')} "
                f"of the mean ({loads} KV tokens; rank policy {event.get('policy')})"
            ),
            p.warn,
        )
    if kind == "scale":
        delta = event.get("delta")
        sign = f"{int(delta):+d} " if isinstance(delta, int | float) else ""
        rest = ", ".join(f"{k}={v}" for k, v in event.items() if k not in _SKIP | {"role", "delta"})
        return "SCALE", f"{event.get('role', '?')} {sign}{rest}".strip(), p.warn
    if kind == "replay":
        try:
            progress = ReplayProgress.model_validate(event)
        except ValidationError:
            progress = None
        return "REPLAY", replay_label(progress) or "replay", ""
    if kind == "advice":
        best = event.get("best") or "keep the active policies"
        return "ADVICE", str(event.get("detail") or f"best: {best}"), p.accent
    if kind == "canary":
        phase = str(event.get("phase", "?"))
        text = f"{event.get('kind')} {event.get('policy')} {phase}: {event.get('detail')}"
        if phase == "end":
            good = event.get("decision") in ("promote", "equal")
            return "CANARY", text, p.ok if good else p.warn
        return "CANARY", text, p.accent if phase == "start" else ""
    if kind == "note":
        return "NOTE", str(event.get("message", "")), str(event.get("style") or p.muted)
    rest = ", ".join(f"{k}={v}" for k, v in event.items() if k not in _SKIP)
    return kind.upper()[:6], rest, ""


class EventLog(RichLog):
    """Bounded, append-only; the app feeds it events with `record()`."""

    def __init__(self, *, max_lines: int = 1000, id: str | None = None) -> None:
        super().__init__(max_lines=max_lines, wrap=False, markup=False, highlight=False, id=id)
        self.recorded = 0
        """How many events were written (tests and the border subtitle read it)."""

    def record(self, event: Mapping[str, Any]) -> None:
        tag, text, style = describe(event, palette_for(self.app))
        ts = event.get("time")
        stamp = time.strftime("%H:%M:%S", time.localtime(float(ts) if isinstance(ts, int | float) else None))
        line = Text.assemble((stamp + " ", "dim"), (f"{tag:<6} ", f"bold {style}".strip()), (text, style))
        self.write(line)
        self.recorded += 1

    def note(self, message: str, style: str = "") -> None:
        """A line from the dashboard itself (connection lost, action failed...)."""
        self.record({"type": "note", "time": time.time(), "message": message, "style": style})
