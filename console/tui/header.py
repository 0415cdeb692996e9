"""The dashboard header: cluster, backend, run, uptime, active policies, replay progress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.tui.fmt import duration, palette_for, pct, policy_label

KIND_ORDER = ("routing", "queue", "reschedule", "scaling", "rank")


def replay_label(replay: Mapping[str, Any] | None) -> str | None:
    """`replay 40% (1200/3000) paused` from the snapshot's optional `replay` object."""
    if not replay:
        return None
    sent, total = replay.get("sent"), replay.get("total")
    status = str(replay.get("status") or ("paused" if replay.get("paused") else "running"))
    progress = ""
    if isinstance(sent, int | float) and isinstance(total, int | float) and total:
        progress = f" {pct(sent / total)} ({int(sent)}/{int(total)})"
    return f"replay{progress} {status}"


class DashboardHeader(Widget):
    """Two lines of context; the app sets `state` on every snapshot and `url` once."""

    state: reactive[dict[str, Any] | None] = reactive(None, always_update=True)
    """The latest `/control/state` snapshot (None until the first one arrives)."""
    url: reactive[str] = reactive("")
    """The console this dashboard talks to."""
    owns_cluster: reactive[bool] = reactive(False)
    """Whether quitting this dashboard stops the cluster (it launched it)."""

    def render(self) -> RenderableType:
        p = palette_for(self.app)
        s = self.state
        line1 = Text.assemble(("◆ sibyl-console ", f"bold {p.accent}"))
        if s is None:
            line1.append(f"connecting to {self.url} …", style=p.muted)
            return line1
        models = s.get("model") or []
        fields = [
            ("cluster", str(s.get("cluster", "?"))),
            ("backend", str(s.get("backend", "?"))),
            ("model", ", ".join(models) if isinstance(models, list) else str(models)),
            ("run", str(s.get("run_id", "?"))),
            ("up", duration(s.get("uptime_s"))),
        ]
        for name, value in fields:
            line1.append(f" {name} ", style=p.muted)
            line1.append(value, style="bold")
        line1.append(f"   {self.url}", style=p.muted)
        if self.owns_cluster:
            line1.append("  (launched here)", style=p.muted)
        if s.get("draining"):
            line1.append("  DRAINING", style=p.warn)
        line2 = Text()
        policies: Mapping[str, Any] = s.get("policies") or {}
        kinds = [k for k in KIND_ORDER if k in policies] + [k for k in policies if k not in KIND_ORDER]
        for kind in kinds:
            line2.append(f" {kind} ", style=p.muted)
            # routing with its params; the other kinds by name (their params are in `p` and `status`)
            label = policy_label(policies[kind]) if kind == "routing" else str(policies[kind].get("name", "?"))
            line2.append(label, style=f"bold {p.accent}")
        queue = s.get("queue") or {}
        if queue.get("depth"):
            by_class = queue.get("by_class") or {}
            parts = ", ".join(f"{k} {v}" for k, v in by_class.items() if v)
            line2.append(f"   queued {queue['depth']}/{queue.get('max_queued', '?')}" + (f" ({parts})" if parts else ""), style=p.warn)
        replay = replay_label(s.get("replay"))
        if replay:
            line2.append("   " + replay, style=p.warn if "paused" in replay else "")
        return Text("\n").join([line1, line2])
