"""The table `sibyl-console sim` prints: the columns that fit the terminal, the most telling first."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.table import Table

if TYPE_CHECKING:
    from rich.console import JustifyMethod


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.1f}"


def _fmt_tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _label(r: dict[str, Any]) -> str:
    params = r["params"]
    return r["policy"] + ("(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


def _ms(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: _fmt_ms(r[key])


def _hit_rate(r: dict[str, Any]) -> str:
    return f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "-"


def _kv_moved(r: dict[str, Any]) -> str:
    if "kv_transferred_tokens" not in r:
        return "-"
    return f"{_fmt_tokens(r['kv_transferred_tokens'])} ({r['kv_transferred_share']:.0%})"


@dataclass(frozen=True)
class Column:
    """One column of the table: its header, how a result row fills it, its rank when space is short."""

    header: str
    cell: Callable[[dict[str, Any]], str]
    rank: int
    """Lower ranks are kept first when the terminal is too narrow for every column."""
    cached_only: bool = False
    """Shown only when a run modelled the prefix cache."""

    @property
    def justify(self) -> JustifyMethod:
        return "left" if self.header in ("policy", "run") else "right"


COLUMNS = (
    Column("policy", _label, 0),
    Column("run", lambda r: r.get("run_id") or "-", 9),
    Column("req", lambda r: str(r["requests"]), 11),
    Column("tok/s", lambda r: f"{r['throughput_tok_s']:.0f}", 4),
    Column("TTFT p50", _ms("ttft_p50"), 5),
    Column("TTFT p99", _ms("ttft_p99"), 2),
    Column("TPOT mean", _ms("tpot_mean"), 10),
    Column("TPOT p50", _ms("tpot_p50"), 6),
    Column("TPOT p99", _ms("tpot_p99"), 3),
    Column("TPOT p99.9", _ms("tpot_p999"), 12),
    Column("SLO att.", lambda r: f"{r['slo_attainment']:.1%}", 1),
    Column(
        "opt. assign",
        lambda r: "-" if math.isnan(r["optimal_assignment_ratio"]) else f"{r['optimal_assignment_ratio']:.1%}",
        13,
    ),
    Column("shed", lambda r: str(r["shed"]), 14),
    Column("expired", lambda r: str(r["expired"]), 15),
    Column("scale ev.", lambda r: str(r["scale_events"]), 16),
    Column("hit rate", _hit_rate, 7, cached_only=True),
    Column("KV moved", _kv_moved, 8, cached_only=True),
)
"""Every column in the order printed; `rank` orders them by importance."""

EDGE = 1
"""Cells a rich table spends on its left edge; each column adds its padding (2) and a border (1)."""


def fitting(columns: list[Column], cells: dict[str, list[str]], width: int | None) -> list[Column]:
    """The most important columns that fit in `width` terminal cells (by rank, stopping at the first
    that does not: no column shows while a more telling one is left out), printed in their own
    order; all of them when `width` is None, and always the first-ranked one."""
    if width is None:
        return columns
    kept: set[str] = set()
    used = EDGE
    for c in sorted(columns, key=lambda c: c.rank):
        need = max(cell_len(x) for x in [c.header, *cells[c.header]]) + 3
        if kept and used + need > width:
            break
        kept.add(c.header)
        used += need
    return [c for c in columns if c.header in kept]


def results_table(rows: list[dict[str, Any]], width: int | None = None) -> Table:
    """One row per simulated policy, with the columns that fit `width` (None: every column); a
    caption names the columns left out and `--json`, which prints every field."""
    cached = any("prefix_hit_rate" in r for r in rows)
    columns = [c for c in COLUMNS if cached or not c.cached_only]
    cells = {c.header: [c.cell(r) for r in rows] for c in columns}
    shown = fitting(columns, cells, width)
    left_out = [c.header for c in columns if c not in shown]
    caption = f"left out at {width} columns: {', '.join(left_out)} (--json prints every field)" if left_out else None
    table = Table(title="simulated policies (times in ms)", caption=caption)
    for c in shown:
        table.add_column(c.header, justify=c.justify)
    for i in range(len(rows)):
        table.add_row(*(cells[c.header][i] for c in shown))
    return table
