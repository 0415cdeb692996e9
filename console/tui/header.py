"""The dashboard header: cluster, backend, run, uptime, active policies, replay progress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.live.state import ConsoleState, ReplayProgress
from console.tui.fmt import duration, palette_for, pct, policy_label

KIND_ORDER = ("routing", "queue", "reschedule", "scaling", "rank")


def replay_label(replay: ReplayProgress | None) -> str | None:
    """`replay 40% (1200/3000) paused` from the snapshot's optional `replay` object."""
    if replay is None:
        return None
    sent, total = replay.sent, replay.total
    status = str(replay.status or ("paused" if replay.paused else "running"))
    progress = ""
    if isinstance(sent, int | float) and isinstance(total, int | float) and total:
        progress = f" {pct(sent / total)} ({int(sent)}/{int(total)})"
    return f"replay{progress} {status}"


class DashboardHeader(Widget):
    """Two lines of context; the app sets `state` on every snapshot and `url` once."""

    state: reactive[ConsoleState | None] = reactive(None, always_update=True)
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
        fields = [
            ("cluster", s.cluster or "?"),
            ("backend", s.backend or "?"),
            ("model", ", ".join(s.model)),
            ("run", s.run_id or "?"),
            ("up", duration(s.uptime_s)),
        ]
        for name, value in fields:
            line1.append(f" {name} ", style=p.muted)
            line1.append(value, style="bold")
        line1.append(f"   {self.url}", style=p.muted)
        if self.owns_cluster:
            line1.append("  (launched here)", style=p.muted)
        if s.draining:
            line1.append("  DRAINING", style=p.warn)
        line2 = Text()
        policies: Mapping[str, Any] = s.policy_entries()
        kinds = [k for k in KIND_ORDER if k in policies] + [k for k in policies if k not in KIND_ORDER]
        for kind in kinds:
            line2.append(f" {kind} ", style=p.muted)
            # routing with its params; the other kinds by name (their params are in `p` and `status`)
            label = policy_label(policies[kind]) if kind == "routing" else str(policies[kind].get("name", "?"))
            line2.append(label, style=f"bold {p.accent}")
        queue = s.queue
        if queue is not None and queue.depth:
            parts = ", ".join(f"{k} {v}" for k, v in queue.by_class.items() if v)
            max_queued = "?" if queue.max_queued is None else queue.max_queued
            line2.append(f"   queued {queue.depth}/{max_queued}" + (f" ({parts})" if parts else ""), style=p.warn)
        served = int((queue.admission or {}).get("served_on_decode", 0)) if queue is not None else 0
        if served:  # admission's local prefill: requests the prefill pool was short for, served anyway
            line2.append(f"   prefilled on decode {served}", style=p.muted)
        replay = replay_label(s.replay)
        if replay:
            line2.append("   " + replay, style=p.warn if "paused" in replay else "")
        return Text("\n").join([line1, line2])
