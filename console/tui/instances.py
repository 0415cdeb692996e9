"""The instance table: one row per instance, prefill group then decode group, sortable, load bars."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from console.live.state import InstanceRow
from console.tui.fmt import Palette, bar, num, palette_for, sparkline

COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "instance"),
    ("role", "role"),
    ("health", "health"),
    ("running", "run"),
    ("waiting", "wait"),
    ("backlog", "backlog"),
    ("kv", "KV"),
    ("tps", "tok/s"),
    ("hit", "hit"),
    ("cached", "cached"),
    ("load", "load"),
    ("bar", "load vs busiest of role"),
    ("trend", "trend"),
)
"""(column key, label) in display order."""
NODE_COLUMN = ("node", "node")
"""Where an instance runs: appended once some instance reports a node (the ray backend)."""
RANKS_COLUMN = ("ranks", "DP ranks (KV tokens, max/mean)")
"""Per-rank load of a data-parallel decode group: appended once some instance is one."""
RANKS_WIDTH = 16
CALIBRATION_COLUMN = ("calib", "calibrated")
"""Whether the instance is projected with its own fitted terms, and their fit's residual: appended once
some instance reports a calibration."""
SORTABLE: tuple[str, ...] = ("id", "health", "running", "waiting", "backlog", "kv", "tps", "hit", "load")
"""Columns the table can sort by, in the order the sort key cycles through them."""
GROUP = {"prefill": 0, "both": 1, "decode": 2}
BAR_WIDTH = 16
TREND_WIDTH = 12


def _queue(inst: InstanceRow) -> float:
    return float(inst.running + inst.waiting)


def _health(inst: InstanceRow, p: Palette) -> Text:
    """UP / DOWN, OPEN / PROBE while its circuit breaker is open or half-open, or the phase while it starts or
    drains."""
    phase = inst.phase or "active"
    breaker = inst.breaker or "closed"
    if breaker == "open":
        return Text("OPEN", style=p.bad)  # its circuit breaker keeps it out of routing
    if breaker == "half_open":
        return Text("PROBE", style=p.warn)
    if phase == "starting":
        return Text("STARTING", style=p.warn)
    if phase == "draining":
        return Text("DRAINING", style=p.warn)
    return Text("UP", style=p.ok) if inst.healthy else Text("DOWN", style=p.bad)


def rank_cell(loads: Sequence[float] | None, p: Palette) -> Text:
    """A DP group's ranks as one bar each (scaled to its busiest rank) and max/mean: the straggler
    factor every step of the group pays (1.0 = balanced)."""
    if not loads:
        return Text("-", style=p.muted)
    top, mean = max(loads), sum(loads) / len(loads)
    factor = top / mean if mean > 0 else 1.0
    style = p.bad if factor >= 1.5 else (p.warn if factor >= 1.2 else "")
    return Text(f"{sparkline(loads, top, RANKS_WIDTH).strip()} x{factor:.2f}", style=style)


def natural(text: str) -> tuple[Any, ...]:
    """`d2` before `d10`: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def _sort_value(inst: InstanceRow, column: str) -> Any:
    if column == "id":
        return natural(inst.id)
    if column == "health":
        return inst.healthy
    if column == "kv":
        return float(inst.kv_usage or 0.0)
    if column == "tps":
        return float(inst.tokens_per_s or 0.0)
    if column == "hit":
        return float(inst.prefix_hit_rate or 0.0)
    if column == "load":
        return inst.load
    if column == "backlog":
        return float(inst.backlog_s or 0.0)
    return float(getattr(inst, column, None) or 0)


def backlog_cell(inst: InstanceRow, p: Palette) -> Text:
    """The prefill backlog admission judges by, in projected seconds to drain ("-": not a prefill instance)."""
    b = inst.backlog_s
    if b is None:
        return Text("-", justify="right", style=p.muted)
    return Text(f"{b:.2f}s" if b < 10 else f"{b:.0f}s", justify="right", style=p.warn if b >= 1.0 else "")


def calibration_cell(inst: InstanceRow, p: Palette) -> Text:
    """"fit ±r%" (its prefill steps are projected with its fitted terms; r the residual), "prior" (not
    identified yet), "-" (no refit yet)."""
    c = inst.calibration
    if c is None:
        return Text("-", style=p.muted)
    if not c.calibrated:
        return Text("prior", style=p.muted)
    residuals = [t.residual for t in c.terms.values() if t.source.startswith("fit") and t.residual is not None]
    return Text(f"fit ±{max(residuals):.0%}" if residuals else "fit", style=p.ok)


def _share(x: float | None) -> str:
    """A prefix-cache share as a whole percent; "-" when nothing was looked up in the window."""
    return "-" if x is None else f"{x:.0%}"


class InstanceTable(DataTable[Any]):
    """Live per-instance values. The app hands it each snapshot's instances through `show()`."""

    sort_column: reactive[str] = reactive("id")
    """Column key the rows are ordered by within each role group."""
    sort_reverse: reactive[bool] = reactive(False)
    """Descending order (numeric columns start descending: busiest first)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._instances: dict[str, InstanceRow] = {}
        self._cells: dict[str, dict[str, Any]] = {}
        self._history: dict[str, deque[float]] = {}
        self._order: list[str] = []
        self._node_column = False
        self._ranks_column = False
        self._calibration_column = False

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._restyle())

    # --- data in ----------------------------------------------------------------------------
    def show(self, instances: Sequence[InstanceRow], *, record: bool = True) -> None:
        """Update rows in place (add new instances, drop gone ones); O(instances).

        `record` appends each load to the row's trend (False when only re-rendering).
        """
        palette = palette_for(self.app)
        if not self._node_column and any(inst.node for inst in instances):
            self._node_column = True
            self.add_column(NODE_COLUMN[1], key=NODE_COLUMN[0], default="")
        if not self._ranks_column and any(inst.dp_ranks for inst in instances):
            self._ranks_column = True
            self.add_column(RANKS_COLUMN[1], key=RANKS_COLUMN[0], default="")
        if not self._calibration_column and any(inst.calibration for inst in instances):
            self._calibration_column = True
            self.add_column(CALIBRATION_COLUMN[1], key=CALIBRATION_COLUMN[0], default="")
        scale: dict[str, float] = {}
        for inst in instances:
            role = inst.role
            scale[role] = max(scale.get(role, 0.0), inst.load)
        # a role the policy projects no load for (prefill, usually) is drawn by its queue instead
        queue_roles = {r for r, top in scale.items() if top <= 0}
        for inst in instances:
            if inst.role in queue_roles:
                role = inst.role
                scale[role] = max(scale[role], _queue(inst))
        seen = set()
        for inst in instances:
            iid = inst.id
            role = inst.role
            seen.add(iid)
            self._instances[iid] = inst
            hist = self._history.setdefault(iid, deque(maxlen=TREND_WIDTH))
            drawn = _queue(inst) if role in queue_roles else inst.load
            if record or not hist:
                hist.append(drawn)
            cells = self._render_row(inst, drawn, hist, scale.get(role, 1.0), palette)
            old = self._cells.get(iid)
            if old is None:
                self.add_row(*cells.values(), key=iid)
            else:
                for key, value in cells.items():
                    if old.get(key) != value:
                        self.update_cell(iid, key, value)
            self._cells[iid] = cells
        for gone in [iid for iid in self._cells if iid not in seen]:
            self.remove_row(gone)
            for store in (self._cells, self._instances, self._history):
                store.pop(gone, None)
        self._resort()

    def _render_row(
        self, inst: InstanceRow, drawn: float, hist: deque[float], scale: float, p: Palette
    ) -> dict[str, Any]:
        healthy = inst.healthy
        role = inst.role
        frac = drawn / scale if scale > 0 else 0.0
        bar_style = p.accent if healthy else p.muted
        kv = inst.kv_usage
        kv_style = p.bad if kv is not None and kv >= 0.95 else (p.warn if kv is not None and kv >= 0.8 else "")
        cells: dict[str, Any] = {
            "id": inst.id,
            "role": Text(role, style=p.accent if role == "prefill" else ""),
            "health": _health(inst, p),
            "running": Text(str(inst.running), justify="right"),
            "waiting": Text(str(inst.waiting), justify="right", style=p.warn if inst.waiting else ""),
            "backlog": backlog_cell(inst, p),
            "kv": Text("-" if kv is None else f"{kv:.0%}", justify="right", style=kv_style),
            "tps": Text(num(inst.tokens_per_s), justify="right"),
            "hit": Text(_share(inst.prefix_hit_rate), justify="right"),
            "cached": Text(_share(inst.cached_share), justify="right"),
            "load": Text(num(inst.projected_load), justify="right"),
            "bar": Text(bar(frac, BAR_WIDTH), style=bar_style),
            "trend": Text(sparkline(hist, scale, TREND_WIDTH), style=bar_style),
        }
        if self._node_column:
            cells["node"] = Text(inst.node or "-", style=p.muted)
        if self._ranks_column:
            cells["ranks"] = rank_cell(inst.dp_ranks, p)
        if self._calibration_column:
            cells["calib"] = calibration_cell(inst, p)
        return cells

    def _restyle(self) -> None:
        """Re-render every row after a theme change (colours come from the theme)."""
        self._cells.clear()
        self.clear()
        instances = list(self._instances.values())
        self._instances.clear()
        self._order = []
        self.show(instances, record=False)

    # --- sorting ----------------------------------------------------------------------------
    def desired_order(self) -> list[str]:
        """Instance ids as they should appear: pool first (several pools), role group next, then the sort column."""
        col, rev = self.sort_column, self.sort_reverse
        groups: dict[tuple[str, int], list[InstanceRow]] = {}
        for inst in self._instances.values():
            groups.setdefault((inst.pool or "", GROUP.get(inst.role, 3)), []).append(inst)
        order: list[str] = []
        for g in sorted(groups):
            rows = sorted(groups[g], key=lambda i: natural(i.id))
            rows.sort(key=lambda i: _sort_value(i, col), reverse=rev)
            order.extend(i.id for i in rows)
        return order

    def _resort(self) -> None:
        order = self.desired_order()
        if order == self._order:
            return
        rank = {iid: n for n, iid in enumerate(order)}
        self.sort("id", key=lambda iid: rank.get(str(iid), len(rank)))
        self._order = order

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        """Order by `column`; the same column again flips the direction."""
        if column not in SORTABLE:
            return
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else column != "id"
        self.sort_column, self.sort_reverse = column, reverse
        self._order = []
        self._resort()
        label = dict(COLUMNS)[column]
        self.border_subtitle = f"sorted by {label} {'↓' if reverse else '↑'}"

    def cycle_sort(self) -> None:
        """Sort by the next sortable column."""
        i = SORTABLE.index(self.sort_column) if self.sort_column in SORTABLE else -1
        self.sort_by(SORTABLE[(i + 1) % len(SORTABLE)])

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def selected_id(self) -> str | None:
        """The instance under the cursor (None in an empty table)."""
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)

    def row_role(self, instance_id: str) -> str:
        row = self._instances.get(instance_id)
        return row.role if row is not None else ""

    def row_texts(self, instance_id: str) -> dict[str, str]:
        """Plain text of one row by column key (for tests and the command palette)."""
        return {k: str(v) for k, v in self._cells.get(instance_id, {}).items()}
